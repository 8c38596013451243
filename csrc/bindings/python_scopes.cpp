// A region's two scopes as a Python type written in C (NOTE: [Scopes as a C type]).

// CPython's stable ABI, 3.10 and later: one build serves every Python the package supports.
#define PY_SSIZE_T_CLEAN
#define Py_LIMITED_API 0x030A0000
#include <Python.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <memory>
#include <string>

#include "bindings/c_api.h"
#include "dispatch/region_scopes.h"
#include "dispatch/site.h"
#include "ops/user_warning.h"

namespace sac {
namespace {

// NOTE: [Scopes as a C type]
// torch's checkpoint makes a region per call through the context function and enters and exits
// its two scopes: five crossings from Python into the library per checkpoint call, and a sixth
// when the region is dropped. Through ctypes each crossing cost about 2 us in a training step
// (the interpreter's and libffi's code paths are cold between two of them): on a block of 64
// small ops that was a fifth of the plugin's whole overhead. Here the scopes are a Python type
// written in C, whose __enter__ and __exit__ are C methods, so each crossing is a C call with
// no argument conversion. They run the very RegionHandle code the torchbind methods and the C
// ABI run (NOTE: [Scopes are checked before they change anything] in region_scopes.h), with the
// same messages and Python exception types. Each scope owns one reference to the region's
// handle, so the region lives while either scope does and dies with the last of them, whichever
// way the step ends.

struct RegionScopeObject {
  PyObject_HEAD RegionHandle* handle;  // one reference, owned
  ActivationKind kind;
  int64_t depth;
  // The recompute's context above the dispatch modes that are on (NOTE: [Modes above the key see
  // only what ran] in sac_plugin/_mode_recompute.py), while it is open; null otherwise.
  PyObject* above_modes;
};

PyTypeObject* region_scope_type = nullptr;
// sac_plugin._mode_recompute.recompute_above_modes, set when that module is imported.
PyObject* recompute_above_modes = nullptr;
// sac_plugin.HeldNeverServedWarning, set when sac_plugin._scopes is imported.
PyObject* never_served_warning = nullptr;

// Whether the exception a context's __exit__ was handed ends the recompute as designed: none, or
// torch's early stop (_StopRecomputationError), raised once every tensor saved for backward is
// recomputed.
bool endedAsDesigned(PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || args[0] == Py_None) return true;
  PyObject* name = PyObject_GetAttrString(args[0], "__name__");
  if (name == nullptr) {
    PyErr_Clear();
    return false;
  }
  const bool early_stop = PyUnicode_CompareWithASCIIString(name, "_StopRecomputationError") == 0;
  Py_DECREF(name);
  return early_stop;
}

// NOTE: [Served, or named] (dispatch/region.cpp): the warning a recompute left, issued where the
// user's warning filters apply. False with the warning raised as an exception (an "error" filter).
bool warnAboutUnservedOutputs(RegionScopeObject* scope, PyObject* const* args, Py_ssize_t nargs) {
  if (scope->kind != ActivationKind::kRecompute) return true;
  const std::string notice = scope->handle->region->takeNeverServedNotice();
  // A recompute that raised has not served what it would have: its error says enough.
  if (notice.empty() || never_served_warning == nullptr || !endedAsDesigned(args, nargs)) return true;
  return PyErr_WarnEx(never_served_warning, notice.c_str(), 1) == 0;
}

// Raises the Python exception a C++ one stands for (the C ABI's statuses make the same choice).
void raiseTranslated() {
  try {
    throw;
  } catch (const c10::ValueError& error) {
    PyErr_SetString(PyExc_ValueError, error.what_without_backtrace());
  } catch (const c10::Error& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what_without_backtrace());
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "sac: unknown C++ exception");
  }
}

// Exits the scope's activation; false with a Python exception set when refused.
bool exitActivation(RegionScopeObject* scope) {
  try {
    scope->handle->exit(scope->kind, scope->depth);
    return true;
  } catch (...) {
    raiseTranslated();
    return false;
  }
}

// With a Python exception set: exits the scope's activation and returns null, the exception still
// the one raised (a refused exit is dropped, not raised in its place).
PyObject* exitKeepingTheError(RegionScopeObject* scope) {
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  if (!exitActivation(scope)) PyErr_Clear();
  PyErr_Restore(type, value, traceback);
  return nullptr;
}

PyObject* newScope(RegionHandle* owned, ActivationKind kind) {
  auto alloc = reinterpret_cast<allocfunc>(PyType_GetSlot(region_scope_type, Py_tp_alloc));
  auto* scope = reinterpret_cast<RegionScopeObject*>(alloc(region_scope_type, 0));
  if (scope == nullptr) {
    c10::intrusive_ptr<RegionHandle>::reclaim(owned);
    return nullptr;
  }
  scope->handle = owned;
  scope->kind = kind;
  scope->depth = 0;
  scope->above_modes = nullptr;
  return reinterpret_cast<PyObject*>(scope);
}

void scopeDealloc(PyObject* self) {
  auto* scope = reinterpret_cast<RegionScopeObject*>(self);
  Py_CLEAR(scope->above_modes);
  // The last reference closes a scope still open on this thread (RegionHandle's destructor).
  if (scope->handle != nullptr) c10::intrusive_ptr<RegionHandle>::reclaim(scope->handle);
  PyTypeObject* type = Py_TYPE(self);
  reinterpret_cast<freefunc>(PyType_GetSlot(type, Py_tp_free))(self);
  Py_DECREF(type);
}

PyObject* scopeEnter(PyObject* self, PyObject* /*unused*/) {
  auto* scope = reinterpret_cast<RegionScopeObject*>(self);
  try {
    scope->depth = scope->handle->enter(scope->kind);
  } catch (...) {
    raiseTranslated();
    return nullptr;
  }
  if (scope->kind == ActivationKind::kRecompute && recompute_above_modes != nullptr &&
      c10::impl::TorchDispatchModeTLS::stack_len() > 0) {
    PyObject* address = PyLong_FromVoidPtr(scope->handle);
    PyObject* above =
        address == nullptr ? nullptr : PyObject_CallFunctionObjArgs(recompute_above_modes, address, nullptr);
    Py_XDECREF(address);
    if (above != nullptr && above != Py_None) {
      PyObject* entered = PyObject_CallMethod(above, "__enter__", nullptr);
      if (entered == nullptr) Py_CLEAR(above);
      Py_XDECREF(entered);
    }
    // The recompute does not run: its activation closes again.
    if (above == nullptr) return exitKeepingTheError(scope);
    if (above == Py_None) {
      Py_DECREF(above);
    } else {
      scope->above_modes = above;
    }
  }
  Py_INCREF(self);
  return self;
}

PyObject* scopeExit(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  auto* scope = reinterpret_cast<RegionScopeObject*>(self);
  PyObject* above = scope->above_modes;
  if (above != nullptr) {
    scope->above_modes = nullptr;
    const bool given = nargs == 3;
    PyObject* result = PyObject_CallMethod(above, "__exit__", "OOO", given ? args[0] : Py_None,
                                           given ? args[1] : Py_None, given ? args[2] : Py_None);
    Py_DECREF(above);
    // The context above the modes raised: the activation closes anyway.
    if (result == nullptr) return exitKeepingTheError(scope);
    Py_DECREF(result);
  }
  if (!exitActivation(scope)) return nullptr;
  if (!warnAboutUnservedOutputs(scope, args, nargs)) return nullptr;
  Py_RETURN_FALSE;
}

PyObject* scopeAddress(PyObject* self, void* /*closure*/) {
  return PyLong_FromVoidPtr(reinterpret_cast<RegionScopeObject*>(self)->handle);
}

PyMethodDef scope_methods[] = {
    {"__enter__", scopeEnter, METH_NOARGS, "Opens the scope on this thread."},
    {"__exit__", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(scopeExit)), METH_FASTCALL,
     "Closes the scope; raises if it cannot be closed here (nothing is changed then)."},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef scope_getset[] = {
    {"address", scopeAddress, nullptr,
     "The region's handle, as the C ABI and torch.ops.sac.region_at take it; valid while the scope lives.", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyType_Slot scope_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(scopeDealloc)},
    {Py_tp_methods, scope_methods},
    {Py_tp_getset, scope_getset},
    {Py_tp_doc, const_cast<char*>("The forward or the recompute of one checkpointed region, as a context manager.")},
    {0, nullptr}};

PyType_Spec scope_spec = {"sac_plugin.RegionScope", sizeof(RegionScopeObject), 0,
                          Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, scope_slots};

// new_region_scopes(site_address) -> (forward, recompute): a new region of the site at
// `site_address` (sac_site_new), its two scopes sharing it.
PyObject* newRegionScopes(PyObject* /*module*/, PyObject* site_address) {
  const void* site = PyLong_AsVoidPtr(site_address);
  if (site == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "sac: new_region_scopes needs a site's address, got 0");
    return nullptr;
  }
  c10::intrusive_ptr<RegionHandle> handle;
  try {
    handle = c10::make_intrusive<RegionHandle>(*static_cast<const std::shared_ptr<Site>*>(site));
  } catch (...) {
    raiseTranslated();
    return nullptr;
  }
  PyObject* forward = newScope(c10::intrusive_ptr<RegionHandle>(handle).release(), ActivationKind::kForward);
  if (forward == nullptr) return nullptr;
  PyObject* recompute = newScope(handle.release(), ActivationKind::kRecompute);
  if (recompute == nullptr) {
    Py_DECREF(forward);
    return nullptr;
  }
  PyObject* scopes = PyTuple_Pack(2, forward, recompute);
  Py_DECREF(forward);
  Py_DECREF(recompute);
  return scopes;
}

// adopt_forward_scope(region_address) -> forward: the forward scope of a region handle made
// elsewhere (a profiling region), adopting the reference that was handed out with it.
PyObject* adoptForwardScope(PyObject* /*module*/, PyObject* region_address) {
  void* handle = PyLong_AsVoidPtr(region_address);
  if (handle == nullptr) {
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_ValueError, "sac: adopt_forward_scope needs a region's address, got 0");
    return nullptr;
  }
  return newScope(static_cast<RegionHandle*>(handle), ActivationKind::kForward);
}

// Makes `value` the object a global of this file refers to (owned), releasing the previous one.
PyObject* replaceGlobal(PyObject** global, PyObject* value) {
  Py_INCREF(value);
  PyObject* previous = *global;
  *global = value;
  Py_XDECREF(previous);
  Py_RETURN_NONE;
}

// set_recompute_above_modes(function): what a recompute scope calls, with its region's address,
// when dispatch modes are on as it opens.
PyObject* setRecomputeAboveModes(PyObject* /*module*/, PyObject* function) {
  return replaceGlobal(&recompute_above_modes, function);
}

// set_never_served_warning(category): the warning class NOTE: [Served, or named] is issued as.
PyObject* setNeverServedWarning(PyObject* /*module*/, PyObject* category) {
  return replaceGlobal(&never_served_warning, category);
}

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
  PyObject* done = replaceGlobal(&info_logger, function);
  setInfoSink(&logThroughPython);
  return done;
}

PyMethodDef module_methods[] = {
    {"new_region_scopes", newRegionScopes, METH_O, "(site_address) -> (forward, recompute) of a new region."},
    {"adopt_forward_scope", adoptForwardScope, METH_O, "(region_address) -> the forward scope, owning the handle."},
    {"set_recompute_above_modes", setRecomputeAboveModes, METH_O,
     "(function) -> None: what a recompute calls when dispatch modes are on."},
    {"set_never_served_warning", setNeverServedWarning, METH_O,
     "(category) -> None: the warning class for kept outputs a recompute never asked for."},
    {"set_info_logger", setInfoLogger, METH_O, "(function) -> None: what the runtime's INFO messages are handed to."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "sac_plugin._scope_types", nullptr, -1, module_methods, nullptr, nullptr, nullptr, nullptr};

}  // namespace
}  // namespace sac

// The module of the scope type, made once; Python asks for it through ctypes (py_object).
SAC_C_API PyObject* sac_python_scope_types() {
  static PyObject* module = nullptr;
  if (module != nullptr) {
    Py_INCREF(module);
    return module;
  }
  PyObject* made = PyModule_Create(&sac::module_def);
  if (made == nullptr) return nullptr;
  PyObject* type = PyType_FromSpec(&sac::scope_spec);
  if (type == nullptr || PyModule_AddObject(made, "RegionScope", type) < 0) {
    Py_XDECREF(type);
    Py_DECREF(made);
    return nullptr;
  }
  sac::region_scope_type = reinterpret_cast<PyTypeObject*>(type);  // the module holds it
  module = made;
  Py_INCREF(module);
  return module;
}
