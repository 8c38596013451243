// sac_plugin._C's queries part: the interception's installation, op-name resolution, the op
// traits the compiled path decides with and the facts of a call Python sees, the open units and
// the offload statistics; stateless calls that take no tensor, so they need no dispatcher op.

#include <cstdint>
#include <limits>
#include <optional>
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

// The fields of what op_traits returns, in order.
enum TraitsField : Py_ssize_t {
  kCollective,
  kNeverCounted,
  kRandom,
  kMutatesInputs,
  kView,
  kDropoutArgument,
  kCopyCast,
  kTraitsFields
};

// op_traits(spelling) -> (collective, never counted, random, mutates inputs, view, dropout_p's
// index or -1, copy cast): the traits the fallback decides with, for Python's policy function under
// torch.compile, so the compiled and the eager selection read one classification.
PyObject* opTraitsOf(PyObject* /*module*/, PyObject* value) {
  std::string spelling;
  if (!toString(value, "an op name", &spelling)) return nullptr;
  return guarded([&] {
    std::vector<c10::OperatorHandle> handles = resolveOpSpelling(spelling);
    TORCH_CHECK_VALUE(handles.size() == 1, "sac: op_traits needs one overload such as 'aten::mm.default', got '",
                      spelling, "' (", handles.size(), " overloads)");
    const OpTraits& traits = lookupOp(handles.front()).traits;
    static_assert(kTraitsFields == 7, "op_traits builds one value per field");
    return Py_BuildValue("(NNNNNLN)", PyBool_FromLong(traits.is_collective), PyBool_FromLong(traits.never_counts),
                         PyBool_FromLong(traits.is_random), PyBool_FromLong(traits.mutates_inputs),
                         PyBool_FromLong(traits.is_view), static_cast<long long>(traits.dropout_p_argument),
                         PyBool_FromLong(traits.is_copy_cast));
  });
}

// --- A call's facts, from Python values (NOTE: [A call's facts are decided here] in ops/op_traits.h)

// The traits a call's facts follow from, read back from what op_traits returned for the call's
// op; false with a TypeError for any other value.
bool callTraitsOf(PyObject* value, OpTraits* traits) {
  PyObject* random = nullptr;
  PyObject* dropout_argument = nullptr;
  PyObject* copy_cast = nullptr;
  if (PyTuple_Check(value) && PyTuple_Size(value) == kTraitsFields) {
    random = PyTuple_GetItem(value, kRandom);
    dropout_argument = PyTuple_GetItem(value, kDropoutArgument);
    copy_cast = PyTuple_GetItem(value, kCopyCast);
  }
  if (random == nullptr || !PyBool_Check(random) || !PyBool_Check(copy_cast) || !PyLong_Check(dropout_argument) ||
      PyBool_Check(dropout_argument)) {
    PyErr_SetString(PyExc_TypeError, "sac: a call's facts need its op's traits, as op_traits returns them");
    return false;
  }
  int64_t index = -1;
  if (!toInt64(dropout_argument, "dropout_p's index", &index)) return false;
  if (index < -1 || index > INT32_MAX) {
    PyErr_Format(PyExc_ValueError, "sac: dropout_p's index must be an argument's or -1, got %lld",
                 static_cast<long long>(index));
    return false;
  }
  traits->is_random = random == Py_True;
  traits->dropout_p_argument = static_cast<int>(index);
  traits->is_copy_cast = copy_cast == Py_True;
  return true;
}

// A call's arguments as a Python front door has them: a tuple or a list, and a dict or None.
bool callArgumentsChecked(PyObject* args, PyObject* kwargs) {
  if (!PyTuple_Check(args) && !PyList_Check(args)) {
    PyErr_SetString(PyExc_TypeError, "sac: a call's positional arguments must be a tuple or a list");
    return false;
  }
  if (kwargs != Py_None && !PyDict_Check(kwargs)) {
    PyErr_SetString(PyExc_TypeError, "sac: a call's keyword arguments must be a dict or None");
    return false;
  }
  return true;
}

// A dropout_p as Python has it, as a number: a float, or an int (a bool too), which is 0 exactly
// when it equals 0.0; nullopt for anything else (a SymFloat while tracing), whose draw cannot be
// ruled out.
std::optional<double> numberOf(PyObject* value) {
  if (PyFloat_Check(value)) return PyFloat_AsDouble(value);
  if (PyLong_Check(value)) {
    const double number = PyLong_AsDouble(value);
    if (number == -1.0 && PyErr_Occurred()) {  // too large for a double, and so not 0
      PyErr_Clear();
      return std::numeric_limits<double>::infinity();
    }
    return number;
  }
  return std::nullopt;
}

// draws_random(traits, args, kwargs) -> whether the call draws random numbers: `traits` is what
// op_traits returned for its op, args and kwargs the call's. A dropout_p the call leaves out is
// 0.0, the default of every op that has one.
PyObject* drawsRandom(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_Format(PyExc_TypeError, "sac: draws_random takes (traits, args, kwargs), got %zd arguments", nargs);
    return nullptr;
  }
  OpTraits traits;
  if (!callTraitsOf(args[0], &traits) || !callArgumentsChecked(args[1], args[2])) return nullptr;
  std::optional<double> dropout_p;
  if (randomOnlyPerCall(traits)) {
    const Py_ssize_t index = traits.dropout_p_argument;
    PyObject* value = nullptr;  // borrowed
    if (index < PySequence_Size(args[1])) {
      value = PyTuple_Check(args[1]) ? PyTuple_GetItem(args[1], index) : PyList_GetItem(args[1], index);
    } else if (args[2] != Py_None) {
      value = PyDict_GetItemString(args[2], "dropout_p");
    }
    dropout_p = value != nullptr ? numberOf(value) : std::optional<double>(0.0);
  }
  return PyBool_FromLong(drawsRandomNumbers(traits, dropout_p));
}

// torch.Tensor, looked up once: the library does not link torch's Python bindings, so a tensor is
// told by its Python type. A new reference held for the life of the process; null with an
// exception set when torch cannot be imported.
PyObject* tensorType() {
  static PyObject* type = nullptr;
  if (type == nullptr) {
    PyObject* torch = PyImport_ImportModule("torch");
    if (torch == nullptr) return nullptr;
    type = PyObject_GetAttrString(torch, "Tensor");
    Py_DECREF(torch);
  }
  return type;
}

// `name` of `object` is true; -1 with an exception set when reading it raises.
int attributeIsTrue(PyObject* object, const char* name) {
  PyObject* value = PyObject_GetAttrString(object, name);
  if (value == nullptr) return -1;
  const int is_true = PyObject_IsTrue(value);
  Py_DECREF(value);
  return is_true;
}

// casts_a_parameter(traits, args) -> whether the call casts a parameter: `traits` is what
// op_traits returned for its op, args the call's positional arguments. Its source (the first) is
// read only for a copy cast, and whether it is a leaf only when it requires grad.
PyObject* castsParameter(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_Format(PyExc_TypeError, "sac: casts_a_parameter takes (traits, args), got %zd arguments", nargs);
    return nullptr;
  }
  OpTraits traits;
  if (!callTraitsOf(args[0], &traits) || !callArgumentsChecked(args[1], Py_None)) return nullptr;
  int requires_grad = 0;
  int is_leaf = 0;
  if (traits.is_copy_cast && PySequence_Size(args[1]) > 0) {
    // Held: the checks below may run Python code, which could empty a list of arguments.
    PyObject* source = PySequence_GetItem(args[1], 0);
    if (source == nullptr) return nullptr;
    PyObject* tensor = tensorType();
    const int is_tensor = tensor != nullptr ? PyObject_IsInstance(source, tensor) : -1;
    if (is_tensor == 1) requires_grad = attributeIsTrue(source, "requires_grad");
    if (requires_grad == 1) is_leaf = attributeIsTrue(source, "is_leaf");
    Py_DECREF(source);
    if (is_tensor < 0 || requires_grad < 0 || is_leaf < 0) return nullptr;
  }
  return PyBool_FromLong(castsAParameter(traits, requires_grad == 1, is_leaf == 1));
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
    {"draws_random", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(drawsRandom)), METH_FASTCALL,
     "(traits, args, kwargs) -> whether the call draws random numbers."},
    {"casts_a_parameter", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(castsParameter)), METH_FASTCALL,
     "(traits, args) -> whether the call casts a parameter."},
    {"offload_stats", offloadStatsOf, METH_NOARGS, "The offload counters, as sac_plugin.memory.OFFLOAD_STATS."},
    {"empty_offload_pool", emptyPool, METH_NOARGS, "Frees the pinned pool's cached buffers; returns their bytes."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

bool addQueriesPart(PyObject* module) { return PyModule_AddFunctions(module, query_functions) == 0; }

}  // namespace python
}  // namespace sac
