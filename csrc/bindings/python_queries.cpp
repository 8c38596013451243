// sac_plugin._C's queries part: the interception's installation, op-name resolution, the op
// traits the compiled path decides with, the open units and the offload statistics; stateless
// calls that take no tensor, so they need no dispatcher op.

#include <string>
#include <vector>

#include "bindings/python_module.h"
#include "dispatch/fallback.h"
#include "dispatch/offload.h"
#include "ops/op_catalog.h"
#include "ops/op_resolution.h"
#include "ops/op_traits.h"
#include "policy/policy.h"
#include "policy/unit_stack.h"

namespace sac {
namespace python {
namespace {

// install_fallback() -> "native" or "coexisting"; raises RuntimeError where neither can be
// installed (the dispatch-mode engine runs then).
PyObject* installFallback(PyObject* /*module*/, PyObject*) {
  return guarded([] { return PyUnicode_FromString(interceptionPathName(installInterception())); });
}

// interception_path() -> how the plugin receives ops ("native", "coexisting", "not installed").
PyObject* interceptionPathOf(PyObject* /*module*/, PyObject*) {
  return guarded([] { return PyUnicode_FromString(interceptionPathName(interceptionPath())); });
}

// open_units() -> the recompute units open on this thread, outermost first.
PyObject* openUnits(PyObject* /*module*/, PyObject*) {
  return guarded([] {
    std::vector<std::string> names;
    for (UnitId unit : UnitStack::current().units()) names.push_back(unitName(unit));
    return fromStrings(names);
  });
}

// resolvable_op_names(names) -> the spellings among `names` that name a registered overload.
PyObject* resolvableNames(PyObject* /*module*/, PyObject* value) {
  std::vector<std::string> names;
  if (!toStrings(value, "op names", &names)) return nullptr;
  return guarded([&] { return fromStrings(resolvableOpNames(names)); });
}

// overloads_of(spelling) -> every overload's qualified name; raises ValueError naming an unknown op.
PyObject* overloadsOf(PyObject* /*module*/, PyObject* value) {
  std::string spelling;
  if (!toString(value, "an op name", &spelling)) return nullptr;
  return guarded([&] {
    std::vector<std::string> names;
    for (const c10::OperatorHandle& op : resolveOpSpelling(spelling)) {
      names.push_back(qualifiedOpName(op.schema().name(), op.schema().overload_name()));
    }
    TORCH_CHECK_VALUE(!names.empty(), "sac: ", describeUnknownOp(spelling));
    return fromStrings(names);
  });
}

// op_traits(spelling) -> (collective, never counted, random, mutates inputs, view, dropout_p's
// index or -1): the traits the fallback decides with, for Python's policy function under
// torch.compile, so the compiled and the eager selection read one classification.
PyObject* opTraitsOf(PyObject* /*module*/, PyObject* value) {
  std::string spelling;
  if (!toString(value, "an op name", &spelling)) return nullptr;
  return guarded([&] {
    std::vector<c10::OperatorHandle> handles = resolveOpSpelling(spelling);
    TORCH_CHECK_VALUE(handles.size() == 1, "sac: op_traits needs one overload such as 'aten::mm.default', got '",
                      spelling, "' (", handles.size(), " overloads)");
    const OpTraits& traits = lookupOp(handles.front()).traits;
    return Py_BuildValue("(NNNNNL)", PyBool_FromLong(traits.is_collective), PyBool_FromLong(traits.never_counts),
                         PyBool_FromLong(traits.is_random), PyBool_FromLong(traits.mutates_inputs),
                         PyBool_FromLong(traits.is_view), static_cast<long long>(traits.dropout_p_argument));
  });
}

// NOTE: [Offloading kept outputs] (dispatch/offload.cpp): copies each way with their bytes, the
// pinned pool's bytes (all, in use, cached), its allocations and trims, and the exposed copy time
// (us), in the order of sac_plugin.memory.OFFLOAD_STATS.
PyObject* offloadStatsOf(PyObject* /*module*/, PyObject*) {
  return guarded([] {
    OffloadStats stats = offloadStats();
    return fromInt64s({stats.copies_to_host, stats.bytes_to_host, stats.copies_to_device, stats.bytes_to_device,
                       stats.pool_bytes, stats.pool_bytes_in_use, stats.pool_bytes_cached, stats.pool_allocations,
                       stats.pool_trims, stats.pool_bytes_trimmed, stats.exposed_copy_us});
  });
}

// empty_offload_pool() -> the pinned bytes freed.
PyObject* emptyPool(PyObject* /*module*/, PyObject*) {
  return guarded([] { return PyLong_FromLongLong(emptyOffloadPool()); });
}

PyMethodDef query_functions[] = {
    {"install_fallback", installFallback, METH_NOARGS, "Installs the interception; returns how ops arrive."},
    {"interception_path", interceptionPathOf, METH_NOARGS, "How the plugin receives ops."},
    {"open_units", openUnits, METH_NOARGS, "The recompute units open on this thread, outermost first."},
    {"resolvable_op_names", resolvableNames, METH_O, "(names) -> those that name a registered overload."},
    {"overloads_of", overloadsOf, METH_O, "(spelling) -> every overload it names."},
    {"op_traits", opTraitsOf, METH_O, "(spelling) -> the traits the fallback decides with."},
    {"offload_stats", offloadStatsOf, METH_NOARGS, "The offload counters, as sac_plugin.memory.OFFLOAD_STATS."},
    {"empty_offload_pool", emptyPool, METH_NOARGS, "Frees the pinned pool's cached buffers; returns their bytes."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

bool addQueriesPart(PyObject* module) { return PyModule_AddFunctions(module, query_functions) == 0; }

}  // namespace python
}  // namespace sac
