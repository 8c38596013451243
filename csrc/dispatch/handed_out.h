#pragma once
// The objects whose addresses the plugin hands to Python as ints, so that an address that comes
// back is checked before it is used (NOTE: [An address that comes back is checked]).

#include <c10/util/Exception.h>

#include <cstdint>
#include <mutex>

#include "ops/hash_containers.h"

namespace sac {

// NOTE: [An address that comes back is checked]
// Some of the plugin's ops and C functions take an object the plugin made earlier as the int
// address it handed out (a dispatch-mode engine's region, a resolved op, a checkpoint site, a
// region handle). Used as it is, any other int (64, a freed object's address) would be read as
// that object and crash the interpreter. So each such object is noted here while it lives, and
// every address that comes back is looked up first: one that names no live object of the type
// asked for raises a ValueError naming the op, and nothing is touched.
template <class T>
class HandedOut {
 public:
  static void add(const T* object) {
    std::lock_guard<std::mutex> lock(mutex());
    live().insert(object);
  }
  static void remove(const T* object) {
    std::lock_guard<std::mutex> lock(mutex());
    live().erase(object);
  }
  // The object at `address`; raises, naming `what` (the op) and `kind` (what it takes), when no
  // live object of this type is there.
  static T& at(int64_t address, const char* what, const char* kind) {
    bool found = false;
    {
      std::lock_guard<std::mutex> lock(mutex());
      found = live().count(reinterpret_cast<const T*>(address)) > 0;
    }
    TORCH_CHECK_VALUE(found, "sac: ", what, " takes the address of ", kind, " the plugin handed out, got ", address,
                      ", which names none (freed, or never one)");
    return *reinterpret_cast<T*>(address);
  }

 private:
  static std::mutex& mutex() {
    static std::mutex* guard = new std::mutex();  // leaked: used until the process ends
    return *guard;
  }
  static HashSet<const T*>& live() {
    static HashSet<const T*>* objects = new HashSet<const T*>();
    return *objects;
  }
};

}  // namespace sac
