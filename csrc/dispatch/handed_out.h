#pragma once
// The objects the plugin's ops take back from Python as an integer handle (NOTE: [A handle that
// comes back is checked]).

#include <c10/util/Exception.h>

#include <cstdint>
#include <mutex>

#include "ops/hash_containers.h"

namespace sac {

// NOTE: [A handle that comes back is checked]
// The dispatch-mode engine's ops take tensors, so they are dispatcher ops, and they act on an
// object the plugin made earlier (a mode region, a resolved op), which an op schema can only name
// as an int. That int is a handle: a serial number handed out when the object was made, never its
// address, so no value Python passes can be read as memory. Each object is in a table by its
// handle while it lives, and every handle that comes back is looked up first: one that names no
// live object of the type asked for raises a ValueError naming the op, and nothing is touched.
template <class T>
class HandedOut {
 public:
  // A new handle (> 0) for `object`, which names it until remove.
  static int64_t add(T* object) {
    std::lock_guard<std::mutex> lock(mutex());
    const int64_t handle = ++last();
    live().emplace(handle, object);
    return handle;
  }
  static void remove(int64_t handle) {
    std::lock_guard<std::mutex> lock(mutex());
    live().erase(handle);
  }
  // The object `handle` names; raises, naming `what` (the op) and `kind` (what it takes), when it
  // names no live object of this type.
  static T& at(int64_t handle, const char* what, const char* kind) {
    T* object = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex());
      auto found = live().find(handle);
      if (found != live().end()) object = found->second;
    }
    TORCH_CHECK_VALUE(object != nullptr, "sac: ", what, " takes the handle of ", kind, " the plugin handed out, got ",
                      handle, ", which names none (freed, or never one)");
    return *object;
  }

 private:
  static std::mutex& mutex() {
    static std::mutex* guard = new std::mutex();  // leaked: used until the process ends
    return *guard;
  }
  static int64_t& last() {
    static int64_t handle = 0;
    return handle;
  }
  static HashMap<int64_t, T*>& live() {
    static HashMap<int64_t, T*>* objects = new HashMap<int64_t, T*>();
    return *objects;
  }
};

}  // namespace sac
