// sac_plugin._C's policy part: Policy, OpEntry and CallDecider, and the keep rule as the Python
// front doors ask it (NOTE: [The keep rule] in policy/policy.cpp; bindings/rule_calls.h).

#include <cstring>
#include <utility>

#include "bindings/python_module.h"
#include "bindings/rule_calls.h"
#include "ops/op_catalog.h"
#include "policy/policy.h"

namespace sac {
namespace python {
namespace {

// --- Policy ----------------------------------------------------------------------------------------

struct PolicyObject {
  PyObject_HEAD std::shared_ptr<const Policy>* policy;  // owned
};

PyTypeObject* policy_type = nullptr;

// A dict from op name to `convert`ed values, in the order Python gave it.
template <class T, class Convert>
bool toRules(PyObject* value, const char* what, const char* expected, std::vector<std::pair<std::string, T>>* out,
             Convert convert) {
  if (!PyDict_Check(value)) {
    PyErr_Format(PyExc_TypeError, "sac: %s must be %s", what, expected);
    return false;
  }
  Py_ssize_t position = 0;
  PyObject* key = nullptr;
  PyObject* item = nullptr;
  while (PyDict_Next(value, &position, &key, &item)) {
    std::pair<std::string, T> rule;
    if (!toString(key, what, &rule.first) || !convert(item, what, &rule.second)) return false;
    out->push_back(std::move(rule));
  }
  return true;
}

// NOTE: [A policy is built from named fields]
// _C.Policy takes PolicySpec's fields by keyword only (the names below), and sac_plugin.Policy
// passes each one by name, so no argument can land in its neighbour's place; a field left out or
// one too many is refused with its name. The rules keyed by op cross as dicts (every_nth_op:
// op -> n; kept_calls, offloaded_calls: op -> indices), in the order Python gave them.
// sac_plugin.Policy has checked every value by then; here only the types are.
PyObject* policyNew(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  static const char* fields[] = {"kept_ops",
                                 "kept_units",
                                 "every_nth_op",
                                 "recomputed_units",
                                 "kept_calls",
                                 "offloaded_ops",
                                 "offloaded_units",
                                 "offloaded_calls",
                                 "offload_min_bytes",
                                 "host_memory_limit",
                                 "pin_routing",
                                 "offload_inputs",
                                 nullptr};
  constexpr int kFields = 12;
  PyObject* values[kFields] = {};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|$OOOOOOOOOOOO:Policy", const_cast<char**>(fields), &values[0],
                                   &values[1], &values[2], &values[3], &values[4], &values[5], &values[6], &values[7],
                                   &values[8], &values[9], &values[10], &values[11])) {
    return nullptr;
  }
  for (int i = 0; i < kFields; ++i) {
    if (values[i] == nullptr) {
      PyErr_Format(PyExc_TypeError, "sac: Policy() is missing the field '%s' (every field is passed by name)",
                   fields[i]);
      return nullptr;
    }
  }
  PolicySpec spec;
  auto to_indices = [](PyObject* item, const char* what, std::vector<int64_t>* out) {
    return toInt64s(item, what, out);
  };
  if (!toStrings(values[0], "kept_ops", &spec.kept_ops) || !toStrings(values[1], "kept_units", &spec.kept_units) ||
      !toRules(values[2], "every_nth_op", "a dict of op name to int", &spec.every_nth_op, toInt64) ||
      !toStrings(values[3], "recomputed_units", &spec.recomputed_units) ||
      !toRules(values[4], "kept_calls", "a dict of op name to a list of int", &spec.kept_calls, to_indices) ||
      !toStrings(values[5], "offloaded_ops", &spec.offloaded_ops) ||
      !toStrings(values[6], "offloaded_units", &spec.offloaded_units) ||
      !toRules(values[7], "offloaded_calls", "a dict of op name to a list of int", &spec.offloaded_calls, to_indices) ||
      !toInt64(values[8], "offload_min_bytes", &spec.offload_min_bytes) ||
      !toInt64(values[9], "host_memory_limit", &spec.host_memory_limit)) {
    return nullptr;
  }
  for (int flag : {10, 11}) {
    if (!PyBool_Check(values[flag])) {
      PyErr_Format(PyExc_TypeError, "sac: %s must be True or False", fields[flag]);
      return nullptr;
    }
  }
  spec.pin_routing = values[10] == Py_True;
  spec.offload_inputs = values[11] == Py_True;
  return guarded([&]() -> PyObject* {
    auto policy = std::make_unique<std::shared_ptr<const Policy>>(Policy::create(spec));
    auto* self = reinterpret_cast<PolicyObject*>(allocate(type));
    if (self != nullptr) self->policy = policy.release();
    return reinterpret_cast<PyObject*>(self);
  });
}

void policyDealloc(PyObject* self) {
  delete reinterpret_cast<PolicyObject*>(self)->policy;
  deallocate(self);
}

const Policy& policyIn(PyObject* self) { return **reinterpret_cast<PolicyObject*>(self)->policy; }

// Call-index rules travel back flattened: op i lists the next counts[i] values of indices.
PyObject* flatCallRules(const std::vector<std::pair<std::string, std::vector<int64_t>>>& rules) {
  std::vector<std::string> ops;
  std::vector<int64_t> counts;
  std::vector<int64_t> indices;
  for (const auto& [op, calls] : rules) {
    ops.push_back(op);
    counts.push_back(static_cast<int64_t>(calls.size()));
    indices.insert(indices.end(), calls.begin(), calls.end());
  }
  return Py_BuildValue("(NNN)", fromStrings(ops), fromInt64s(counts), fromInt64s(indices));
}

PyObject* keptOps(PyObject* self, PyObject*) { return fromStrings(policyIn(self).keptOpNames()); }
PyObject* keptUnits(PyObject* self, PyObject*) { return fromStrings(policyIn(self).keptUnitNames()); }
PyObject* recomputedUnits(PyObject* self, PyObject*) { return fromStrings(policyIn(self).recomputedUnitNames()); }
PyObject* offloadedOps(PyObject* self, PyObject*) { return fromStrings(policyIn(self).offloadedOpNames()); }
PyObject* offloadedUnits(PyObject* self, PyObject*) { return fromStrings(policyIn(self).offloadedUnitNames()); }
PyObject* keptCalls(PyObject* self, PyObject*) { return flatCallRules(policyIn(self).keptCalls()); }
PyObject* offloadedCalls(PyObject* self, PyObject*) { return flatCallRules(policyIn(self).offloadedCalls()); }
PyObject* pinRouting(PyObject* self, PyObject*) { return PyBool_FromLong(policyIn(self).pinsRouting()); }
PyObject* offloadInputs(PyObject* self, PyObject*) { return PyBool_FromLong(policyIn(self).offloadsInputs()); }
PyObject* keepsNothing(PyObject* self, PyObject*) { return PyBool_FromLong(policyIn(self).keepsNothing()); }

PyObject* everyNthOp(PyObject* self, PyObject*) {
  std::vector<std::string> ops;
  std::vector<int64_t> every;
  for (const auto& [op, n] : policyIn(self).everyNthOps()) {
    ops.push_back(op);
    every.push_back(n);
  }
  return Py_BuildValue("(NN)", fromStrings(ops), fromInt64s(every));
}

PyMethodDef policy_methods[] = {
    {"kept_ops", keptOps, METH_NOARGS, "Every kept overload's qualified name, sorted."},
    {"kept_units", keptUnits, METH_NOARGS, "The kept units' names and patterns."},
    {"recomputed_units", recomputedUnits, METH_NOARGS, "The recomputed units' names and patterns."},
    {"every_nth_op", everyNthOp, METH_NOARGS, "(ops, n): the every-nth rules."},
    {"kept_calls", keptCalls, METH_NOARGS, "(ops, counts, indices): the kept-call rules, flattened."},
    {"offloaded_ops", offloadedOps, METH_NOARGS, "Every offloaded overload's qualified name, sorted."},
    {"offloaded_units", offloadedUnits, METH_NOARGS, "The offloaded units' names and patterns."},
    {"offloaded_calls", offloadedCalls, METH_NOARGS, "(ops, counts, indices): the offloaded-call rules."},
    {"pin_routing", pinRouting, METH_NOARGS,
     "Whether routing calls are kept (NOTE: [Routing is served from the forward])."},
    {"offload_inputs", offloadInputs, METH_NOARGS, "Whether the region's activation inputs are offloaded."},
    {"keeps_nothing", keepsNothing, METH_NOARGS, "Whether no call is ever kept or offloaded."},
    {nullptr, nullptr, 0, nullptr}};

PyType_Slot policy_slots[] = {
    {Py_tp_new, reinterpret_cast<void*>(policyNew)},
    {Py_tp_dealloc, reinterpret_cast<void*>(policyDealloc)},
    {Py_tp_methods, policy_methods},
    {Py_tp_doc, const_cast<char*>("The keep rule's policy (C++ sac::Policy), from PolicySpec's fields by name.")},
    {0, nullptr}};

PyType_Spec policy_spec = {"sac_plugin._C.Policy", sizeof(PolicyObject), 0, Py_TPFLAGS_DEFAULT, policy_slots};

// --- OpEntry ---------------------------------------------------------------------------------------

struct OpEntryObject {
  PyObject_HEAD const OpEntry* entry;  // the catalog's, which lives as long as the process
};

PyTypeObject* op_entry_type = nullptr;

const OpEntry* entryOf(PyObject* object) {
  if (!PyObject_TypeCheck(object, op_entry_type)) {
    PyErr_SetString(PyExc_TypeError, "sac: a decision needs an OpEntry (op_entry(name))");
    return nullptr;
  }
  return reinterpret_cast<OpEntryObject*>(object)->entry;
}

PyObject* opEntryName(PyObject* self, void*) {
  return fromString(reinterpret_cast<OpEntryObject*>(self)->entry->traits.qualified_name);
}

void opEntryDealloc(PyObject* self) { deallocate(self); }

PyGetSetDef op_entry_getset[] = {
    {"name", opEntryName, nullptr, "The overload's qualified name (\"aten::mm\" for a default overload).", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyType_Slot op_entry_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(opEntryDealloc)},
    {Py_tp_getset, op_entry_getset},
    {Py_tp_doc, const_cast<char*>("One op overload's catalog entry, as op_entry(name) returns it.")},
    {0, nullptr}};

PyType_Spec op_entry_spec = {"sac_plugin._C.OpEntry", sizeof(OpEntryObject), 0,
                             Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, op_entry_slots};

// op_entry(name) -> OpEntry: the entry of exactly one overload (singleOverload in rule_calls.h).
PyObject* opEntry(PyObject* /*module*/, PyObject* name) {
  std::string spelling;
  if (!toString(name, "an op name", &spelling)) return nullptr;
  return guarded([&]() -> PyObject* {
    const OpEntry& entry = singleOverload(spelling);
    auto* self = reinterpret_cast<OpEntryObject*>(allocate(op_entry_type));
    if (self != nullptr) self->entry = &entry;
    return reinterpret_cast<PyObject*>(self);
  });
}

// --- CallDecider -----------------------------------------------------------------------------------

struct CallDeciderObject {
  PyObject_HEAD CallDecider* decider;  // owned
};

PyObject* deciderNew(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject* policy = nullptr;
  static const char* names[] = {"policy", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O:CallDecider", const_cast<char**>(names), &policy)) return nullptr;
  const std::shared_ptr<const Policy>* held = policyOf(policy, "CallDecider");
  if (held == nullptr) return nullptr;
  return guarded([&]() -> PyObject* {
    auto decider = std::make_unique<CallDecider>(*held);
    auto* self = reinterpret_cast<CallDeciderObject*>(allocate(type));
    if (self != nullptr) self->decider = decider.release();
    return reinterpret_cast<PyObject*>(self);
  });
}

void deciderDealloc(PyObject* self) {
  delete reinterpret_cast<CallDeciderObject*>(self)->decider;
  deallocate(self);
}

// The open units as ids + 1, in a per-thread vector that keeps its capacity.
const std::vector<int64_t>* unitIds(PyObject* units) {
  thread_local std::vector<int64_t> ids;
  if (!toInt64s(units, "the open units (unit ids + 1)", &ids)) return nullptr;
  return &ids;
}

// decide(op, pass, units, facts) -> int: the next call of `op` (an OpEntry) in pass 0 (forward)
// or 1 (recompute), with `units` (ids + 1, outermost first) open; the int is encodeDecision's.
PyObject* deciderDecide(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_Format(PyExc_TypeError, "sac: decide takes (op_entry, pass, units, facts), got %zd arguments", nargs);
    return nullptr;
  }
  const OpEntry* entry = entryOf(args[0]);
  int64_t pass = 0;
  int64_t facts = 0;
  if (entry == nullptr || !toInt64(args[1], "pass", &pass) || !toInt64(args[3], "facts", &facts)) return nullptr;
  const std::vector<int64_t>* units = unitIds(args[2]);
  if (units == nullptr) return nullptr;
  CallDecider& decider = *reinterpret_cast<CallDeciderObject*>(self)->decider;
  return guarded([&] { return PyLong_FromLongLong(decideNextCall(decider, *entry, pass, *units, facts)); });
}

PyMethodDef decider_methods[] = {
    {"decide", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(deciderDecide)), METH_FASTCALL,
     "(op_entry, pass, units, facts) -> the next call's decision, encoded (bindings/rule_calls.h)."},
    {nullptr, nullptr, 0, nullptr}};

PyType_Slot decider_slots[] = {
    {Py_tp_new, reinterpret_cast<void*>(deciderNew)},
    {Py_tp_dealloc, reinterpret_cast<void*>(deciderDealloc)},
    {Py_tp_methods, decider_methods},
    {Py_tp_doc, const_cast<char*>("Decides one region's calls, numbering each op's calls per pass as the native "
                                  "fallback numbers them (C++ sac::CallDecider).")},
    {0, nullptr}};

PyType_Spec decider_spec = {"sac_plugin._C.CallDecider", sizeof(CallDeciderObject), 0, Py_TPFLAGS_DEFAULT,
                            decider_slots};

// policy_decide(policy, op, units, call_index, facts) -> int: one call whose index among the
// region's counted calls of its op the caller knows (the planner).
PyObject* policyDecide(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_Format(PyExc_TypeError,
                 "sac: policy_decide takes (policy, op_entry, units, call_index, facts), got %zd arguments", nargs);
    return nullptr;
  }
  const std::shared_ptr<const Policy>* policy = policyOf(args[0], "policy_decide");
  if (policy == nullptr) return nullptr;
  const OpEntry* entry = entryOf(args[1]);
  int64_t call_index = 0;
  int64_t facts = 0;
  if (entry == nullptr || !toInt64(args[3], "call_index", &call_index) || !toInt64(args[4], "facts", &facts)) {
    return nullptr;
  }
  const std::vector<int64_t>* units = unitIds(args[2]);
  if (units == nullptr) return nullptr;
  return guarded([&] { return PyLong_FromLongLong(decideIndexedCall(**policy, *entry, *units, call_index, facts)); });
}

// reason_text(reason) -> str, or None for an int that is no Reason.
PyObject* reasonTextOf(PyObject* /*module*/, PyObject* value) {
  int64_t reason = 0;
  if (!toInt64(value, "reason", &reason)) return nullptr;
  if (reason < 0 || reason >= kNumReasons) Py_RETURN_NONE;
  return PyUnicode_FromString(reasonText(static_cast<Reason>(reason)));
}

PyMethodDef policy_functions[] = {
    {"op_entry", opEntry, METH_O, "(name) -> the OpEntry of the one overload `name` names."},
    {"policy_decide", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(policyDecide)), METH_FASTCALL,
     "(policy, op_entry, units, call_index, facts) -> one call's decision, encoded."},
    {"reason_text", reasonTextOf, METH_O, "(reason) -> its label, or None for an int that is no Reason."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

const std::shared_ptr<const Policy>* policyOf(PyObject* object, const char* what) {
  if (policy_type == nullptr || !PyObject_TypeCheck(object, policy_type)) {
    PyErr_Format(PyExc_TypeError, "sac: %s needs a _C.Policy (sac_plugin.Policy holds one)", what);
    return nullptr;
  }
  return reinterpret_cast<PolicyObject*>(object)->policy;
}

bool addPolicyPart(PyObject* module) {
  policy_type = addType(module, &policy_spec);
  op_entry_type = policy_type != nullptr ? addType(module, &op_entry_spec) : nullptr;
  return op_entry_type != nullptr && addType(module, &decider_spec) != nullptr &&
         PyModule_AddIntConstant(module, "REASON_COUNT", kNumReasons) == 0 &&
         PyModule_AddFunctions(module, policy_functions) == 0;
}

}  // namespace python
}  // namespace sac
