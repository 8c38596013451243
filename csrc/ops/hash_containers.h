#pragma once
// Hash containers for the hot path. Abseil's Swiss tables where the build has abseil
// (tools/setup.sh installs libabsl-dev); std:: containers where it has not (many CUDA images ship
// no abseil C++ headers), so the plugin still builds there. Code uses only what both
// offer: find/count/emplace/try_emplace/erase/operator[] and iteration.

#include <cstddef>
#include <functional>
#include <utility>

#if SAC_HAVE_ABSL
#include <absl/container/flat_hash_map.h>
#include <absl/container/flat_hash_set.h>
#else
#include <unordered_map>
#include <unordered_set>
#endif

namespace sac {

#if SAC_HAVE_ABSL
template <class Key, class Value>
using HashMap = absl::flat_hash_map<Key, Value>;
template <class Key>
using HashSet = absl::flat_hash_set<Key>;
#else
template <class T>
struct StdHash : std::hash<T> {};
template <class A, class B>
struct StdHash<std::pair<A, B> > {
  size_t operator()(const std::pair<A, B>& p) const noexcept {
    return std::hash<A>{}(p.first) * 31u + std::hash<B>{}(p.second);
  }
};
template <class Key, class Value>
using HashMap = std::unordered_map<Key, Value, StdHash<Key> >;
template <class Key>
using HashSet = std::unordered_set<Key, StdHash<Key> >;
#endif

}  // namespace sac
