#pragma once
// One object of type T per thread, reached with one thread-local lookup.

#include <c10/macros/Macros.h>

namespace sac {

// NOTE: [One lookup per thread-local object]
// A shared library reaches its thread-locals through __tls_get_addr, a call into the dynamic
// loader. A thread-local with a constructor or a destructor costs two of them on every access:
// one for its "constructed yet" guard, one for the object. An intercepted call reaches several
// such objects (its thread's state, unit stack and argument stacks), and on a block of small ops
// those lookups would be about a twentieth of the plugin's instructions. So the per-call path
// reaches each through a plain pointer, which needs no guard (one lookup), set from the owning
// thread-local on the thread's first access only. The object lives as a function-local
// thread_local does: built on first use, destroyed at thread exit.
template <class T>
class PerThread {
 public:
  static T& get() {
    T* object = instance_;
    return C10_LIKELY(object != nullptr) ? *object : firstAccess();
  }

 private:
  C10_NOINLINE static T& firstAccess() {
    static thread_local T owner;
    instance_ = &owner;
    return owner;
  }
  static thread_local T* instance_;
};

template <class T>
thread_local T* PerThread<T>::instance_ = nullptr;

}  // namespace sac
