// sac_plugin._C: the module's entry point, what its parts share, and its module-level functions.

#include "bindings/python_module.h"

#include <c10/util/Exception.h>

#include <cstring>
#include <exception>

#include "ops/user_warning.h"
#include "policy/offload_rule.h"

// NOTE: [One extension module]
// The plugin's shared library is two things at once. Loaded by torch.ops.load_library, its
// TORCH_LIBRARY blocks register torch.ops.sac.* (what must be a dispatcher op: the calls that take
// or return tensors) and the dispatch key's kernels. Imported as the extension
// module sac_plugin._C (PyInit__C below; Python's loader opens the same file, and dlopen hands back
// the object already loaded), it gives Python owned types: Policy, Site, Region, RegionScope,
// OpEntry, CallDecider, CallProfile, Audit, Counts, CallTrace. Each holds its C++ object by a reference-counted pointer
// and never hands out an address, so no value Python passes can be read as memory, and each C++ object dies with the
// last Python object holding it, whichever way a step ends.
//
// A call into _C is a C call with no argument conversion beyond CPython's: about 50 ns, against
// 0.4 us through ctypes and 3-5 us through a torchbind method (pybind11 dispatch, a schema match,
// the GIL released and taken back). A checkpointed region makes five such calls (NOTE: [Scopes as
// a C type] in python_scopes.cpp) and the dispatch-mode engine and torch.compile's policy function
// one per op, which is why these are not torchbind methods. The module is compiled against
// CPython's stable ABI (3.10 and later), so one build serves every Python the package supports;
// it does not link libpython: the interpreter that loads it provides those symbols.

namespace sac {
namespace python {

void raiseTranslated() {
  try {
    throw;
  } catch (const c10::ValueError& error) {
    PyErr_SetString(PyExc_ValueError, error.what_without_backtrace());
  } catch (const c10::TypeError& error) {
    PyErr_SetString(PyExc_TypeError, error.what_without_backtrace());
  } catch (const c10::Error& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what_without_backtrace());
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "sac: unknown C++ exception");
  }
}

PyObject* allocate(PyTypeObject* type) {
  auto alloc = reinterpret_cast<allocfunc>(PyType_GetSlot(type, Py_tp_alloc));
  return alloc(type, 0);
}

void deallocate(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  reinterpret_cast<freefunc>(PyType_GetSlot(type, Py_tp_free))(self);
  Py_DECREF(type);
}

namespace {

void typeError(const char* what, const char* expected, PyObject* value) {
  PyObject* type_name = PyObject_GetAttrString(reinterpret_cast<PyObject*>(Py_TYPE(value)), "__name__");
  const char* name = type_name != nullptr ? PyUnicode_AsUTF8AndSize(type_name, nullptr) : nullptr;
  if (name == nullptr) PyErr_Clear();
  PyErr_Format(PyExc_TypeError, "sac: %s must be %s, got %s", what, expected, name != nullptr ? name : "?");
  Py_XDECREF(type_name);
}

}  // namespace

bool toInt64(PyObject* value, const char* what, int64_t* out) {
  if (!PyLong_Check(value) || PyBool_Check(value)) {
    typeError(what, "an int", value);
    return false;
  }
  const long long converted = PyLong_AsLongLong(value);
  if (converted == -1 && PyErr_Occurred()) return false;  // OverflowError, naming the range
  *out = static_cast<int64_t>(converted);
  return true;
}

bool toString(PyObject* value, const char* what, std::string* out) {
  if (!PyUnicode_Check(value)) {
    typeError(what, "a str", value);
    return false;
  }
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(value, &size);
  if (data == nullptr) return false;
  out->assign(data, static_cast<size_t>(size));
  return true;
}

namespace {

// Each item of the list or tuple `value`, converted by `convert`.
template <class T, class Convert>
bool toVector(PyObject* value, const char* what, const char* expected, std::vector<T>* out, Convert convert) {
  if (!PyList_Check(value) && !PyTuple_Check(value)) {
    typeError(what, expected, value);
    return false;
  }
  const Py_ssize_t size = PySequence_Size(value);
  if (size < 0) return false;
  out->clear();
  out->reserve(static_cast<size_t>(size));
  for (Py_ssize_t i = 0; i < size; ++i) {
    PyObject* item = PySequence_GetItem(value, i);
    if (item == nullptr) return false;
    T converted{};
    const bool ok = convert(item, what, &converted);
    Py_DECREF(item);
    if (!ok) return false;
    out->push_back(std::move(converted));
  }
  return true;
}

}  // namespace

bool toStrings(PyObject* value, const char* what, std::vector<std::string>* out) {
  return toVector(value, what, "a list of str", out, toString);
}

bool toInt64s(PyObject* value, const char* what, std::vector<int64_t>* out) {
  return toVector(value, what, "a list of int", out, toInt64);
}

PyObject* fromString(const std::string& value) {
  return PyUnicode_FromStringAndSize(value.data(), static_cast<Py_ssize_t>(value.size()));
}

PyObject* fromStrings(const std::vector<std::string>& values) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(values.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject* item = fromString(values[i]);
    if (item == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SetItem(list, static_cast<Py_ssize_t>(i), item);  // steals the reference
  }
  return list;
}

PyObject* fromInt64s(const std::vector<int64_t>& values) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(values.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject* item = PyLong_FromLongLong(values[i]);
    if (item == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SetItem(list, static_cast<Py_ssize_t>(i), item);
  }
  return list;
}

PyTypeObject* addType(PyObject* module, PyType_Spec* spec) {
  PyObject* type = PyType_FromSpec(spec);
  if (type == nullptr) return nullptr;
  const char* dot = std::strrchr(spec->name, '.');
  if (PyModule_AddObject(module, dot != nullptr ? dot + 1 : spec->name, type) < 0) {
    Py_DECREF(type);
    return nullptr;
  }
  return reinterpret_cast<PyTypeObject*>(type);  // the module holds it
}

namespace {

PyObject* info_logger = nullptr;  // a callable taking one str: the package logger's info

// NOTE: [What the rule recomputes by design is logged, not warned] (ops/user_warning.h): the sink.
// Ops may run with the GIL released; the sink takes it. A logger that raises is not the op's
// failure: its error is printed and cleared.
void logThroughPython(const std::string& message) {
  PyGILState_STATE gil = PyGILState_Ensure();
  if (info_logger != nullptr) {
    PyObject* result =
        PyObject_CallFunction(info_logger, "s#", message.data(), static_cast<Py_ssize_t>(message.size()));
    if (result == nullptr) {
      PyErr_Print();
    } else {
      Py_DECREF(result);
    }
  }
  PyGILState_Release(gil);
}

// set_info_logger(function): what INFO messages of the runtime are handed to.
PyObject* setInfoLogger(PyObject* /*module*/, PyObject* function) {
  Py_INCREF(function);
  PyObject* previous = info_logger;
  info_logger = function;
  Py_XDECREF(previous);
  setInfoSink(&logThroughPython);
  Py_RETURN_NONE;
}

// offload_placement(bytes, reserved_host_bytes, offload_min_bytes, host_memory_limit) -> int:
// sac::offloadPlacement (NOTE: [Where an offloaded call's outputs live] in
// policy/offload_rule.cpp): 0 host, 1 device (under offload_min_bytes), 2 device (host_memory_limit
// reached); host_memory_limit -1 for none.
PyObject* offloadPlacementOf(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_Format(PyExc_TypeError, "sac: offload_placement takes 4 ints, got %zd arguments", nargs);
    return nullptr;
  }
  static const char* const names[] = {"bytes", "reserved_host_bytes", "offload_min_bytes", "host_memory_limit"};
  int64_t values[4];
  for (int i = 0; i < 4; ++i) {
    if (!toInt64(args[i], names[i], &values[i])) return nullptr;
  }
  return PyLong_FromLong(static_cast<long>(offloadPlacement(values[0], values[1], values[2], values[3])));
}

PyMethodDef module_functions[] = {
    {"set_info_logger", setInfoLogger, METH_O, "(function) -> None: what the runtime's INFO messages are handed to."},
    {"offload_placement", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(offloadPlacementOf)),
     METH_FASTCALL, "(bytes, reserved_host_bytes, offload_min_bytes, host_memory_limit) -> where they live."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT,
                          "sac_plugin._C",
                          "sac_plugin's compiled runtime (NOTE: [One extension module] in "
                          "csrc/bindings/python_module.cpp).",
                          -1,
                          module_functions,
                          nullptr,
                          nullptr,
                          nullptr,
                          nullptr};

}  // namespace
}  // namespace python
}  // namespace sac

// Python's loader finds this by the module's last name; the library is loaded once per process.
extern "C" __attribute__((visibility("default"))) PyObject* PyInit__C() {
  static PyObject* module = nullptr;
  if (module != nullptr) {
    Py_INCREF(module);
    return module;
  }
  PyObject* made = PyModule_Create(&sac::python::module_def);
  if (made == nullptr) return nullptr;
  if (PyModule_AddIntConstant(made, "ABI_VERSION", sac::python::kModuleVersion) < 0 ||
      !sac::python::addPolicyPart(made) || !sac::python::addScopesPart(made) || !sac::python::addProfilePart(made) ||
      !sac::python::addDiagnosticsPart(made) || !sac::python::addQueriesPart(made)) {
    Py_DECREF(made);
    return nullptr;
  }
  module = made;
  Py_INCREF(module);
  return module;
}
