#include "ops/op_resolution.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <tuple>
#include <utility>

#include "ops/hash_containers.h"
#include "ops/op_traits.h"

namespace sac {
namespace {

// NOTE: [Indexing op names by registration epoch]
// Dispatcher::getAllOpNames() copies the name of every registered op (thousands) under the
// dispatcher's lock, so resolving "aten::mm" by scanning it cost a full scan per spelling, and
// a policy or an audit naming the same op 16,000 times took seconds. Instead every op name is
// indexed by base name once, and the index is rebuilt only when the set of ops changed. The
// dispatcher tells registration listeners about every op registered (also, once, about every op
// already registered when the listener is added) and deregistered; ours only bumps an atomic
// epoch, because listeners are called while the dispatcher holds its own lock, so doing any
// dispatcher work (or taking our index lock) there could deadlock. The epoch is read before the
// scan, so an op registered during a rebuild bumps it again and the next lookup rebuilds.
struct OpIndex {
  std::atomic<uint64_t> epoch{0};
  std::mutex mutex;
  std::optional<uint64_t> built_for;  // epoch of the last rebuild
  HashMap<std::string, std::vector<c10::OperatorName>> by_base;
  std::vector<std::string> base_names;  // sorted, unique
  std::atomic<uint64_t> rebuilds{0};
  std::optional<c10::RegistrationHandleRAII> listener_handle;
};

class EpochListener final : public c10::OpRegistrationListener {
 public:
  explicit EpochListener(OpIndex* index) : index_(index) {}
  void onOperatorRegistered(const c10::OperatorHandle&) override { bump(); }
  void onOperatorDeregistered(const c10::OperatorHandle&) override { bump(); }

 private:
  void bump() { index_->epoch.fetch_add(1, std::memory_order_acq_rel); }
  OpIndex* index_;
};

OpIndex& opIndex() {
  // Leaked on purpose, like the op catalog: ops may register and deregister during shutdown.
  static OpIndex* instance = [] {
    auto* index = new OpIndex();
    index->listener_handle.emplace(
        c10::Dispatcher::singleton().addRegistrationListener(std::make_unique<EpochListener>(index)));
    return index;
  }();
  return *instance;
}

// Runs `visit` with the index current, under its lock.
template <class Visit>
auto withOpIndex(Visit&& visit) {
  OpIndex& index = opIndex();
  std::lock_guard<std::mutex> lock(index.mutex);
  const uint64_t epoch = index.epoch.load(std::memory_order_acquire);
  if (index.built_for != epoch) {
    index.by_base.clear();
    for (const c10::OperatorName& name : c10::Dispatcher::singleton().getAllOpNames()) {
      index.by_base[name.name].push_back(name);
    }
    index.base_names.clear();
    index.base_names.reserve(index.by_base.size());
    for (const auto& entry : index.by_base) index.base_names.push_back(entry.first);
    std::sort(index.base_names.begin(), index.base_names.end());
    index.built_for = epoch;
    index.rebuilds.fetch_add(1, std::memory_order_relaxed);
  }
  return visit(index);
}

size_t distanceBetween(size_t a, size_t b) { return a > b ? a - b : b - a; }

// Levenshtein distance of a and b if it is at most `bound`, else bound + 1, computing only the
// diagonal band |i - j| <= bound (cells farther out cost more than `bound` anyway) and stopping
// at the first row whose every cell exceeds it. Adds the cells computed to `cells`.
size_t boundedEditDistance(const std::string& a, const std::string& b, size_t bound, uint64_t& cells) {
  const size_t over = bound + 1;
  if (distanceBetween(a.size(), b.size()) > bound) return over;
  std::vector<size_t> previous(b.size() + 1, over), current(b.size() + 1, over);
  for (size_t j = 0; j <= std::min(b.size(), bound); ++j) previous[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    const size_t lo = i > bound ? i - bound : 1;
    const size_t hi = std::min(b.size(), i + bound);
    current[lo - 1] = lo == 1 && i <= bound ? i : over;
    size_t row_min = current[lo - 1];
    for (size_t j = lo; j <= hi; ++j) {
      size_t substitution = previous[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      size_t value = std::min({previous[j] + 1, current[j - 1] + 1, substitution, over});
      current[j] = value;
      row_min = std::min(row_min, value);
    }
    cells += hi >= lo ? hi - lo + 1 : 0;
    if (hi < b.size()) current[hi + 1] = over;  // the next row reads one cell further right
    if (row_min > bound) return over;
    std::swap(previous, current);
  }
  return std::min(previous[b.size()], over);
}

// Misspellings worth suggesting a name for are a few edits away; farther names are noise.
constexpr size_t kMaxSuggestionDistance = 8;

// Whether a and b are next to each other on a QWERTY keyboard (letters and digits).
bool keyboardNeighbours(char a, char b) {
  static const char* const kRows[] = {"1234567890", "qwertyuiop", "asdfghjkl", "zxcvbnm"};
  auto find = [](char c, int& row, int& column) {
    for (row = 0; row < 4; ++row) {
      const char* at = std::strchr(kRows[row], c);
      if (c != '\0' && at != nullptr) {
        column = static_cast<int>(at - kRows[row]);
        return true;
      }
    }
    return false;
  };
  int row_a = 0, column_a = 0, row_b = 0, column_b = 0;
  if (!find(a, row_a, column_a) || !find(b, row_b, column_b)) return false;
  // Staggered rows: a key touches the two keys below it at its column and the one to the left.
  if (row_a == row_b) return column_a - column_b == 1 || column_b - column_a == 1;
  if (row_a - row_b == 1) return column_b - column_a == 0 || column_b - column_a == 1;
  if (row_b - row_a == 1) return column_a - column_b == 0 || column_a - column_b == 1;
  return false;
}

// Ranking the suggestions:
// Names are ranked by edit distance first. Short names tie often (for 'aten::mn', aten::mH,
// aten::mT, aten::min and aten::mm are each one edit away), and a tie broken alphabetically
// offers the unlikely ones first; so ties are broken by how likely each edit is as a typo, in
// half edits: a substitution by a keyboard neighbour, or of a letter's case, costs 1; another
// substitution, an insertion or a deletion 2; a substitution that also changes the case 3.
// Then by name, so that the order never depends on the registry's.
size_t typoCost(const std::string& a, const std::string& b) {
  std::vector<size_t> previous(b.size() + 1), current(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) previous[j] = 2 * j;
  for (size_t i = 1; i <= a.size(); ++i) {
    current[0] = 2 * i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const unsigned char x = static_cast<unsigned char>(a[i - 1]), y = static_cast<unsigned char>(b[j - 1]);
      size_t substitution = 0;
      if (x != y) {
        const int lx = std::tolower(x), ly = std::tolower(y);
        const bool case_changes = std::isupper(x) != std::isupper(y);
        if (lx == ly) {
          substitution = 1;
        } else if (!case_changes && keyboardNeighbours(static_cast<char>(lx), static_cast<char>(ly))) {
          substitution = 1;
        } else {
          substitution = case_changes ? 3 : 2;
        }
      }
      current[j] = std::min({previous[j] + 2, current[j - 1] + 2, previous[j - 1] + substitution});
    }
    std::swap(previous, current);
  }
  return previous[b.size()];
}

}  // namespace

std::string printableName(const std::string& name) {
  constexpr size_t kShown = 80;
  std::string shown;
  const size_t length = std::min(name.size(), kShown);
  for (size_t i = 0; i < length; ++i) {
    unsigned char c = static_cast<unsigned char>(name[i]);
    if (c < 0x20 || c == 0x7f) {
      char escaped[5];
      std::snprintf(escaped, sizeof(escaped), "\\x%02x", c);
      shown += escaped;
    } else {
      shown += name[i];
    }
  }
  if (name.size() > kShown) shown += "... (" + std::to_string(name.size()) + " characters)";
  return shown;
}

OpSpelling parseOpSpelling(const std::string& spelling) {
  TORCH_CHECK_VALUE(spelling.size() <= kMaxOpNameLength, "sac: an op name has at most ", kMaxOpNameLength,
                    " characters, got one of ", spelling.size(), ": '", printableName(spelling), "'");
  TORCH_CHECK_VALUE(spelling.find('\0') == std::string::npos, "sac: an op name cannot contain a NUL character, got '",
                    printableName(spelling), "'");
  std::string ns, rest;
  size_t colons = spelling.find("::");
  if (colons != std::string::npos) {
    ns = spelling.substr(0, colons);
    rest = spelling.substr(colons + 2);
  } else {
    size_t dot = spelling.find('.');
    if (dot != std::string::npos) {
      ns = spelling.substr(0, dot);
      rest = spelling.substr(dot + 1);
    }
  }
  TORCH_CHECK_VALUE(!ns.empty() && !rest.empty(), "sac: '", printableName(spelling),
                    "' is not an op name; expected 'namespace::op' (every overload), "
                    "'namespace::op.overload' or 'namespace::op.default', e.g. 'aten::mm.default'");
  OpSpelling parsed;
  size_t dot = rest.find('.');
  parsed.base_name = ns + "::" + rest.substr(0, dot);
  if (dot == std::string::npos) {
    parsed.every_overload = true;
  } else {
    parsed.overload = rest.substr(dot + 1);
    if (parsed.overload == "default") parsed.overload.clear();
  }
  return parsed;
}

std::vector<c10::OperatorHandle> resolveOpSpelling(const std::string& spelling) {
  OpSpelling parsed = parseOpSpelling(spelling);
  c10::Dispatcher& dispatcher = c10::Dispatcher::singleton();
  std::vector<c10::OperatorHandle> handles;
  if (!parsed.every_overload) {
    if (auto handle = dispatcher.findSchema({parsed.base_name, parsed.overload})) {
      handles.push_back(*handle);
    }
    return handles;
  }
  std::vector<c10::OperatorName> names = withOpIndex([&](OpIndex& index) {
    auto it = index.by_base.find(parsed.base_name);
    return it == index.by_base.end() ? std::vector<c10::OperatorName>() : it->second;
  });
  for (const c10::OperatorName& name : names) {
    // findSchema skips an op that deregistered since the index was read (it has no schema).
    if (auto handle = dispatcher.findSchema(name)) handles.push_back(*handle);
  }
  return handles;
}

uint64_t opIndexRebuilds() { return opIndex().rebuilds.load(std::memory_order_relaxed); }

std::vector<std::string> closestOpNames(const std::string& spelling, size_t limit, uint64_t* work) {
  std::string wanted = spelling;
  try {
    wanted = parseOpSpelling(spelling).base_name;
  } catch (const c10::Error&) {
  }
  // The work is bounded whatever the input: only names within kMaxSuggestionDistance edits can
  // be offered, so only names whose length is that close are compared at all (a 1,000-character
  // string is compared with none), each on a band of 2 * bound + 1 diagonals, and the bound
  // tightens to the worst of the `limit` best found so far.
  size_t bound = std::min(kMaxSuggestionDistance, std::max<size_t>(2, wanted.size() / 3));
  uint64_t cells = 0;
  // Every name within the bound is kept while the bound tightens, ties at the worst distance
  // included: they are ranked among themselves below (typoCost says how).
  std::vector<std::pair<size_t, std::string>> best;  // sorted by (distance, name)
  if (limit > 0) {
    withOpIndex([&](OpIndex& index) {
      for (const std::string& name : index.base_names) {
        if (distanceBetween(name.size(), wanted.size()) > bound) continue;
        size_t distance = boundedEditDistance(wanted, name, bound, cells);
        if (distance > bound) continue;
        std::pair<size_t, std::string> candidate(distance, name);
        best.insert(std::upper_bound(best.begin(), best.end(), candidate), std::move(candidate));
        if (best.size() >= limit && best[limit - 1].first < bound) {
          bound = best[limit - 1].first;
          while (best.back().first > bound) best.pop_back();
        }
      }
      return 0;
    });
  }
  if (work != nullptr) *work = cells;
  std::vector<std::tuple<size_t, size_t, std::string>> ranked;
  ranked.reserve(best.size());
  for (auto& [distance, name] : best) {
    size_t cost = typoCost(wanted, name);
    ranked.emplace_back(distance, cost, std::move(name));
  }
  std::sort(ranked.begin(), ranked.end());
  if (ranked.size() > limit) ranked.resize(limit);
  std::vector<std::string> closest;
  for (auto& entry : ranked) closest.push_back(std::move(std::get<2>(entry)));
  return closest;
}

std::string describeUnknownOp(const std::string& spelling) {
  std::ostringstream message;
  message << "unknown op '" << printableName(spelling) << "'";
  OpSpelling parsed = parseOpSpelling(spelling);
  if (!parsed.every_overload) {
    std::vector<c10::OperatorHandle> overloads = resolveOpSpelling(parsed.base_name);
    if (!overloads.empty()) {
      message << " (" << parsed.base_name << " has no overload '"
              << (parsed.overload.empty() ? "default" : printableName(parsed.overload)) << "'; it has:";
      std::vector<std::string> names;
      for (const c10::OperatorHandle& op : overloads) names.push_back(op.schema().overload_name());
      std::sort(names.begin(), names.end());
      for (const std::string& overload : names) {
        message << " " << parsed.base_name << "." << (overload.empty() ? "default" : overload);
      }
      message << ")";
      return message.str();
    }
  }
  std::vector<std::string> closest = closestOpNames(spelling, 3);
  if (closest.empty()) {
    message << "; no registered op has a similar name";
    return message.str();
  }
  message << "; closest registered names:";
  const char* separator = " ";
  for (const std::string& name : closest) {
    message << separator << name;
    separator = ", ";
  }
  return message.str();
}

}  // namespace sac
