// Test-only entry points: registered on the plugin's op namespace because Python tests call them
// as torch.ops.sac.*, but no part of the package uses them and they are not its API. Production
// code enters units through the C ABI (sac_unit_push, c_api.h).

#include <torch/library.h>

#include <cstdint>
#include <string>

#include "dispatch/region.h"
#include "ops/op_resolution.h"
#include "policy/unit_stack.h"

namespace sac {
namespace testing {
namespace {

int64_t pushUnit(const std::string& name) { return static_cast<int64_t>(UnitStack::current().push(internUnit(name))); }

void popUnit(const std::string& name, int64_t depth) {
  TORCH_CHECK_VALUE(depth > 0, "sac: unit depth must be positive, got ", depth);
  UnitStack::current().pop(internUnit(name), static_cast<size_t>(depth));
}

}  // namespace
}  // namespace testing
}  // namespace sac

TORCH_LIBRARY_FRAGMENT(sac, m) {
  // Units opened and closed by name, to test the unit stack's checks from Python.
  m.def("push_unit(str name) -> int", &sac::testing::pushUnit);
  m.def("pop_unit(str name, int depth) -> ()", &sac::testing::popUnit);
  // Regions alive in the process: tests check that checkpointed steps free theirs.
  m.def("live_regions() -> int", []() { return sac::Region::liveCount(); });
  // How often op resolution rescanned the dispatcher (resolution is cached).
  m.def("op_index_rebuilds() -> int", []() { return static_cast<int64_t>(sac::opIndexRebuilds()); });
}
