// sac_plugin._C's profile part: CallProfile, a layer's calls as the planner measures them
// (dispatch/call_profile.h).

#include <memory>
#include <string>
#include <vector>

#include "bindings/python_module.h"
#include "dispatch/call_profile.h"
#include "dispatch/region_scopes.h"
#include "policy/policy.h"
#include "policy/unit_stack.h"

namespace sac {
namespace python {
namespace {

struct Profiled {
  std::shared_ptr<CallProfile> profile = std::make_shared<CallProfile>();
  // A profiling region keeps nothing: it records.
  std::shared_ptr<const Policy> keeps_nothing = Policy::create(PolicySpec{});
};

struct CallProfileObject {
  PyObject_HEAD Profiled* profiled;  // owned
};

PyObject* profileNew(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  if (!PyArg_ParseTuple(args, ":CallProfile") || (kwargs != nullptr && PyDict_Size(kwargs) > 0)) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "sac: CallProfile() takes no arguments");
    return nullptr;
  }
  return guarded([&]() -> PyObject* {
    auto profiled = std::make_unique<Profiled>();
    auto* self = reinterpret_cast<CallProfileObject*>(allocate(type));
    if (self != nullptr) self->profiled = profiled.release();
    return reinterpret_cast<PyObject*>(self);
  });
}

void profileDealloc(PyObject* self) {
  delete reinterpret_cast<CallProfileObject*>(self)->profiled;
  deallocate(self);
}

Profiled& profiledIn(PyObject* self) { return *reinterpret_cast<CallProfileObject*>(self)->profiled; }

// new_region_forward() -> RegionScope: the forward scope of a new profiling region of this profile.
PyObject* newRegionForward(PyObject* self, PyObject*) {
  Profiled& profiled = profiledIn(self);
  return guarded([&] {
    return newForwardScope(
        c10::make_intrusive<RegionHandle>(c10::make_intrusive<Region>(profiled.keeps_nothing, profiled.profile)));
  });
}

PyObject* beginRun(PyObject* self, PyObject*) {
  return guarded([&] {
    profiledIn(self).profile->beginRun();
    Py_RETURN_NONE;
  });
}

PyObject* endRun(PyObject* self, PyObject*) {
  return guarded([&] {
    profiledIn(self).profile->endRun();
    Py_RETURN_NONE;
  });
}

PyObject* runs(PyObject* self, PyObject*) { return PyLong_FromLongLong(profiledIn(self).profile->runs()); }

PyObject* recordedInRun(PyObject* self, PyObject*) {
  return PyLong_FromLongLong(profiledIn(self).profile->recordedInRun());
}

// note_layer_outputs(storages): after the first run, the storages the layer returned, by identity
// (each tensor's untyped_storage()._cdata, only compared, never read).
PyObject* noteLayerOutputs(PyObject* self, PyObject* storages) {
  std::vector<int64_t> keys;
  if (!toInt64s(storages, "the layer's output storages", &keys)) return nullptr;
  return guarded([&] {
    profiledIn(self).profile->noteLayerOutputs(std::vector<uintptr_t>(keys.begin(), keys.end()));
    Py_RETURN_NONE;
  });
}

// rows() -> (ops, indices, units, output bytes, why not keepable, seconds): one row per call of the
// first run: op, index among the op's calls, innermost unit ("" for none), new output bytes, why it
// cannot be kept ("" when it can), and every run's seconds, flattened call-major (runs() per call).
PyObject* rows(PyObject* self, PyObject*) {
  return guarded([&]() -> PyObject* {
    std::vector<std::string> ops, units, why;
    std::vector<int64_t> indices, sizes;
    std::vector<double> seconds;
    for (const ProfiledCall& call : profiledIn(self).profile->calls()) {
      ops.push_back(call.op->traits.qualified_name);
      indices.push_back(static_cast<int64_t>(call.index));
      units.push_back(call.unit == kNoUnit ? std::string() : unitName(call.unit));
      sizes.push_back(call.output_bytes);
      why.push_back(call.not_keepable);
      seconds.insert(seconds.end(), call.seconds.begin(), call.seconds.end());
    }
    PyObject* times = PyList_New(static_cast<Py_ssize_t>(seconds.size()));
    if (times == nullptr) return nullptr;
    for (size_t i = 0; i < seconds.size(); ++i) {
      PyObject* value = PyFloat_FromDouble(seconds[i]);
      if (value == nullptr) {
        Py_DECREF(times);
        return nullptr;
      }
      PyList_SetItem(times, static_cast<Py_ssize_t>(i), value);
    }
    return Py_BuildValue("(NNNNNN)", fromStrings(ops), fromInt64s(indices), fromStrings(units), fromInt64s(sizes),
                         fromStrings(why), times);
  });
}

PyMethodDef profile_methods[] = {
    {"new_region_forward", newRegionForward, METH_NOARGS, "() -> the forward scope of a new profiling region."},
    {"begin_run", beginRun, METH_NOARGS, "Starts a run."},
    {"end_run", endRun, METH_NOARGS, "Ends it."},
    {"runs", runs, METH_NOARGS, "Runs ended so far."},
    {"recorded_in_run", recordedInRun, METH_NOARGS, "Calls recorded so far in this run."},
    {"note_layer_outputs", noteLayerOutputs, METH_O, "(storages) -> None: what the layer returned."},
    {"rows", rows, METH_NOARGS, "(ops, indices, units, bytes, why, seconds), one row per call."},
    {nullptr, nullptr, 0, nullptr}};

PyType_Slot profile_slots[] = {
    {Py_tp_new, reinterpret_cast<void*>(profileNew)},
    {Py_tp_dealloc, reinterpret_cast<void*>(profileDealloc)},
    {Py_tp_methods, profile_methods},
    {Py_tp_doc, const_cast<char*>("A layer's calls over profiling runs (C++ sac::CallProfile).")},
    {0, nullptr}};

PyType_Spec profile_spec = {"sac_plugin._C.CallProfile", sizeof(CallProfileObject), 0, Py_TPFLAGS_DEFAULT,
                            profile_slots};

}  // namespace

bool addProfilePart(PyObject* module) { return addType(module, &profile_spec) != nullptr; }

}  // namespace python
}  // namespace sac
