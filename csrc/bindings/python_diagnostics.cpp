// sac_plugin._C's diagnostics part: Audit, Counts and CallTrace, what audits, reports and the
// per-op trace read of the counters (diagnostics/audit.h, dispatch/call_trace.h).

#include <memory>
#include <string>
#include <vector>

#include "bindings/python_module.h"
#include "diagnostics/audit.h"
#include "dispatch/call_trace.h"
#include "dispatch/region.h"
#include "dispatch/region_scopes.h"
#include "ops/op_resolution.h"
#include "policy/unit_stack.h"

namespace sac {
namespace python {
namespace {

// Columns in AuditRow's order (python/sac_plugin/_audit.py): op, forward, recompute and backward
// executions, hits, never-served calls and bytes, skipped calls.
PyObject* auditColumns(const std::vector<AuditRow>& rows) {
  std::vector<std::string> ops;
  std::vector<int64_t> columns[7];
  for (const AuditRow& row : rows) {
    ops.push_back(row.op);
    const int64_t values[7] = {
        static_cast<int64_t>(row.counts.executions[0]), static_cast<int64_t>(row.counts.executions[1]),
        static_cast<int64_t>(row.counts.executions[2]), static_cast<int64_t>(row.counts.hits),
        static_cast<int64_t>(row.counts.never_served),  static_cast<int64_t>(row.counts.never_served_bytes),
        static_cast<int64_t>(row.counts.skipped)};
    for (int i = 0; i < 7; ++i) columns[i].push_back(values[i]);
  }
  return Py_BuildValue("(NNNNNNNN)", fromStrings(ops), fromInt64s(columns[0]), fromInt64s(columns[1]),
                       fromInt64s(columns[2]), fromInt64s(columns[3]), fromInt64s(columns[4]), fromInt64s(columns[5]),
                       fromInt64s(columns[6]));
}

// An object of one of this file's types: a C++ value it owns.
template <class Value>
struct Holder {
  PyObject_HEAD Value* value;  // owned
};

template <class Value>
Value& valueIn(PyObject* self) {
  return *reinterpret_cast<Holder<Value>*>(self)->value;
}

template <class Value>
PyObject* holderNew(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  if (PyTuple_Size(args) != 0 || (kwargs != nullptr && PyDict_Size(kwargs) > 0)) {
    PyErr_SetString(PyExc_TypeError, "sac: this type takes no arguments");
    return nullptr;
  }
  return guarded([&]() -> PyObject* {
    auto value = std::make_unique<Value>();
    auto* self = reinterpret_cast<Holder<Value>*>(allocate(type));
    if (self != nullptr) self->value = value.release();
    return reinterpret_cast<PyObject*>(self);
  });
}

template <class Value>
void holderDealloc(PyObject* self) {
  delete reinterpret_cast<Holder<Value>*>(self)->value;
  deallocate(self);
}

// --- Audit -------------------------------------------------------------------------------------------

struct AuditState {
  ~AuditState() { scope.abandon(ActivationKind::kAudit, nullptr); }

  CounterBaseline baseline;
  OpenScope scope;
  bool started = false;
  bool stopped = false;
  std::vector<AuditRow> final_rows;

  std::vector<AuditRow> rows() const { return stopped ? final_rows : baseline.changesSince(); }
};

PyObject* auditStart(PyObject* self, PyObject*) {
  AuditState& audit = valueIn<AuditState>(self);
  return guarded([&] {
    TORCH_CHECK(!audit.started, "sac: an audit can be started once; create a new audit()");
    audit.baseline = CounterBaseline::capture();
    audit.scope.enter(ActivationKind::kAudit, nullptr);
    audit.started = true;
    Py_RETURN_NONE;
  });
}

PyObject* auditStop(PyObject* self, PyObject*) {
  AuditState& audit = valueIn<AuditState>(self);
  return guarded([&] {
    TORCH_CHECK(audit.started && !audit.stopped, "sac: stopping an audit that is not running; nothing was changed");
    audit.scope.checkExit("an audit");
    audit.final_rows = audit.baseline.changesSince();
    audit.stopped = true;
    audit.scope.exit(ActivationKind::kAudit, nullptr);
    Py_RETURN_NONE;
  });
}

PyObject* auditRunning(PyObject* self, PyObject*) {
  const AuditState& audit = valueIn<AuditState>(self);
  return PyBool_FromLong(audit.started && !audit.stopped);
}

PyObject* auditRows(PyObject* self, PyObject*) {
  return guarded([&] { return auditColumns(valueIn<AuditState>(self).rows()); });
}

PyObject* auditTable(PyObject* self, PyObject*) {
  return guarded([&] { return fromString(formatAuditTable(valueIn<AuditState>(self).rows())); });
}

PyMethodDef audit_methods[] = {
    {"start", auditStart, METH_NOARGS, "Starts counting on this thread's activation stack."},
    {"stop", auditStop, METH_NOARGS, "Stops; refuses (changing nothing) where it cannot stop here."},
    {"running", auditRunning, METH_NOARGS, "Whether it has started and not stopped."},
    {"rows", auditRows, METH_NOARGS, "The counts since start, as columns in AuditRow's order."},
    {"table", auditTable, METH_NOARGS, "The counts as a table."},
    {nullptr, nullptr, 0, nullptr}};

PyType_Slot audit_slots[] = {
    {Py_tp_new, reinterpret_cast<void*>(holderNew<AuditState>)},
    {Py_tp_dealloc, reinterpret_cast<void*>(holderDealloc<AuditState>)},
    {Py_tp_methods, audit_methods},
    {Py_tp_doc, const_cast<char*>("The op counts of the calls made while it runs (sac_plugin.audit).")},
    {0, nullptr}};

PyType_Spec audit_spec = {"sac_plugin._C.Audit", sizeof(Holder<AuditState>), 0, Py_TPFLAGS_DEFAULT, audit_slots};

// --- Counts --------------------------------------------------------------------------------------------

// This thread's counts since it was made, with no activation of its own: a report's per-pass and
// per-unit counts, taken inside the report's audit, which open and close in whatever order the
// passes and units of nested reports do.
struct CountsState {
  CounterBaseline baseline = CounterBaseline::capture();
};

PyObject* countsRows(PyObject* self, PyObject*) {
  return guarded([&] { return auditColumns(valueIn<CountsState>(self).baseline.changesSince()); });
}

PyMethodDef counts_methods[] = {
    {"rows", countsRows, METH_NOARGS, "The counts since it was made, as columns in AuditRow's order."},
    {nullptr, nullptr, 0, nullptr}};

PyType_Slot counts_slots[] = {
    {Py_tp_new, reinterpret_cast<void*>(holderNew<CountsState>)},
    {Py_tp_dealloc, reinterpret_cast<void*>(holderDealloc<CountsState>)},
    {Py_tp_methods, counts_methods},
    {Py_tp_doc, const_cast<char*>("This thread's op counts since it was made, with no activation of its own.")},
    {0, nullptr}};

PyType_Spec counts_spec = {"sac_plugin._C.Counts", sizeof(Holder<CountsState>), 0, Py_TPFLAGS_DEFAULT, counts_slots};

// --- CallTrace ---------------------------------------------------------------------------------------

// A per-op trace (dispatch/call_trace.h); Python installs it on the thread of each region pass.
struct TraceState {
  std::shared_ptr<CallTrace> trace = std::make_shared<CallTrace>();
};

PyObject* traceInstall(PyObject* self, PyObject*) {
  return guarded([&] {
    CallTrace::install(valueIn<TraceState>(self).trace);
    Py_RETURN_NONE;
  });
}

PyObject* traceUninstall(PyObject* self, PyObject*) {
  return guarded([&] {
    CallTrace::uninstall(valueIn<TraceState>(self).trace.get());
    Py_RETURN_NONE;
  });
}

PyObject* traceSize(PyObject* self, PyObject*) { return PyLong_FromSize_t(valueIn<TraceState>(self).trace->size()); }

// Columns, one row per call in the order decided: op, phase, outcome, innermost unit ("" none).
PyObject* traceRows(PyObject* self, PyObject*) {
  return guarded([&]() -> PyObject* {
    std::vector<std::string> ops, phases, outcomes, units;
    for (const TracedCall& call : valueIn<TraceState>(self).trace->calls()) {
      ops.push_back(call.op->traits.qualified_name);
      phases.push_back(phaseName(call.phase));
      outcomes.push_back(callOutcomeName(call.outcome));
      units.push_back(call.unit == kNoUnit ? std::string() : unitName(call.unit));
    }
    return Py_BuildValue("(NNNN)", fromStrings(ops), fromStrings(phases), fromStrings(outcomes), fromStrings(units));
  });
}

PyMethodDef trace_methods[] = {{"install", traceInstall, METH_NOARGS, "Records this thread's calls until uninstall."},
                               {"uninstall", traceUninstall, METH_NOARGS, "Stops recording this thread's calls."},
                               {"size", traceSize, METH_NOARGS, "Calls recorded so far."},
                               {"rows", traceRows, METH_NOARGS, "(ops, phases, outcomes, units), one row per call."},
                               {nullptr, nullptr, 0, nullptr}};

PyType_Slot trace_slots[] = {
    {Py_tp_new, reinterpret_cast<void*>(holderNew<TraceState>)},
    {Py_tp_dealloc, reinterpret_cast<void*>(holderDealloc<TraceState>)},
    {Py_tp_methods, trace_methods},
    {Py_tp_doc, const_cast<char*>("A per-op trace of the calls regions decide (C++ sac::CallTrace).")},
    {0, nullptr}};

PyType_Spec trace_spec = {"sac_plugin._C.CallTrace", sizeof(Holder<TraceState>), 0, Py_TPFLAGS_DEFAULT, trace_slots};

// --- Process-wide counts ---------------------------------------------------------------------------

// live_regions() -> int: regions alive in the process; a step that frees its regions leaves it
// where it found it (what leak checks read).
PyObject* liveRegions(PyObject* /*module*/, PyObject*) { return PyLong_FromLongLong(Region::liveCount()); }

// op_index_rebuilds() -> int: how often op-name resolution rescanned the dispatcher (it is cached,
// and rescans only when an op was registered since).
PyObject* opIndexRebuildCount(PyObject* /*module*/, PyObject*) {
  return PyLong_FromUnsignedLongLong(opIndexRebuilds());
}

PyMethodDef diagnostics_functions[] = {
    {"live_regions", liveRegions, METH_NOARGS, "Regions alive in the process."},
    {"op_index_rebuilds", opIndexRebuildCount, METH_NOARGS, "How often op-name resolution rescanned the dispatcher."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

bool addDiagnosticsPart(PyObject* module) {
  return addType(module, &audit_spec) != nullptr && addType(module, &counts_spec) != nullptr &&
         addType(module, &trace_spec) != nullptr && PyModule_AddFunctions(module, diagnostics_functions) == 0;
}

}  // namespace python
}  // namespace sac
