#include "policy/op_resolution.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <set>
#include <sstream>
#include <utility>

#include "policy/op_traits.h"

namespace sac {
namespace {

size_t editDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> previous(b.size() + 1), current(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) previous[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    current[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t substitution = previous[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      current[j] = std::min({previous[j] + 1, current[j - 1] + 1, substitution});
    }
    std::swap(previous, current);
  }
  return previous[b.size()];
}

}  // namespace

OpSpelling parseOpSpelling(const std::string& spelling) {
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
  TORCH_CHECK_VALUE(!ns.empty() && !rest.empty(), "sac: '", spelling,
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
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name != parsed.base_name) continue;
    if (auto handle = dispatcher.findSchema(name)) handles.push_back(*handle);
  }
  return handles;
}

std::vector<std::string> closestOpNames(const std::string& spelling, size_t limit) {
  std::string wanted = spelling;
  try {
    wanted = parseOpSpelling(spelling).base_name;
  } catch (const c10::Error&) {
  }
  std::set<std::string> base_names;
  for (const c10::OperatorName& name : c10::Dispatcher::singleton().getAllOpNames()) {
    base_names.insert(name.name);
  }
  std::vector<std::pair<size_t, std::string>> ranked;
  ranked.reserve(base_names.size());
  for (const std::string& name : base_names) ranked.emplace_back(editDistance(wanted, name), name);
  std::sort(ranked.begin(), ranked.end());
  std::vector<std::string> closest;
  for (size_t i = 0; i < ranked.size() && closest.size() < limit; ++i) {
    closest.push_back(ranked[i].second);
  }
  return closest;
}

std::string describeUnknownOp(const std::string& spelling) {
  std::ostringstream message;
  message << "unknown op '" << spelling << "'";
  OpSpelling parsed = parseOpSpelling(spelling);
  if (!parsed.every_overload) {
    std::vector<c10::OperatorHandle> overloads = resolveOpSpelling(parsed.base_name);
    if (!overloads.empty()) {
      message << " (" << parsed.base_name << " has no overload '"
              << (parsed.overload.empty() ? "default" : parsed.overload) << "'; it has:";
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
  message << "; closest registered names:";
  const char* separator = " ";
  for (const std::string& name : closestOpNames(spelling, 3)) {
    message << separator << name;
    separator = ", ";
  }
  return message.str();
}

}  // namespace sac
