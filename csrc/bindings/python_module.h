#pragma once
// sac_plugin._C, the package's one extension module (NOTE: [One extension module] in
// python_module.cpp): what its parts share. Every file that includes this one is compiled against
// CPython's stable ABI.

#define PY_SSIZE_T_CLEAN
#define Py_LIMITED_API 0x030A0000
#include <Python.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace sac {

class Policy;
struct RegionHandle;

namespace python {

// Bumped when a type, a function or a meaning changes; Python (sac_plugin/_native.py) refuses a
// module of another version.
inline constexpr int kModuleVersion = 11;

// Raises the Python exception a C++ one stands for (c10::ValueError: ValueError, c10::TypeError:
// TypeError, any other: RuntimeError, with the message without its C++ backtrace). Call it in a
// catch block.
void raiseTranslated();

// Runs `body`, which returns a new reference; a C++ exception becomes the Python one.
template <class Body>
PyObject* guarded(Body&& body) {
  try {
    return body();
  } catch (...) {
    raiseTranslated();
    return nullptr;
  }
}

// A new, zeroed instance of the heap type `type` (its tp_alloc).
PyObject* allocate(PyTypeObject* type);
// The tail of a heap type's tp_dealloc: frees `self`, then drops the reference it held to its type.
void deallocate(PyObject* self);

// Conversions from Python; false with a TypeError naming `what` and the value's type when the
// value is not of the kind asked for.
bool toInt64(PyObject* value, const char* what, int64_t* out);
bool toString(PyObject* value, const char* what, std::string* out);
bool toStrings(PyObject* value, const char* what, std::vector<std::string>* out);
bool toInt64s(PyObject* value, const char* what, std::vector<int64_t>* out);
// Conversions to Python: new references, null with an exception set.
PyObject* fromStrings(const std::vector<std::string>& values);
PyObject* fromInt64s(const std::vector<int64_t>& values);
PyObject* fromString(const std::string& value);

// Makes the heap type `spec` describes and adds it to `module` under its short name; the module
// holds the type. Null with an exception set on failure.
PyTypeObject* addType(PyObject* module, PyType_Spec* spec);

// The parts of the module, each adding its types and functions; false with an exception set.
bool addPolicyPart(PyObject* module);       // python_policy.cpp: Policy, OpEntry, CallDecider, the rule
bool addScopesPart(PyObject* module);       // python_scopes.cpp: Site, Region, RegionScope, units
bool addProfilePart(PyObject* module);      // python_profile.cpp: CallProfile
bool addDiagnosticsPart(PyObject* module);  // python_diagnostics.cpp: Audit, Counts, CallTrace
bool addQueriesPart(PyObject* module);      // python_queries.cpp: installation, op names, offload stats

// The policy a _C.Policy holds; null with a TypeError naming `what` for any other object.
const std::shared_ptr<const Policy>* policyOf(PyObject* object, const char* what);
// The forward scope of `handle`'s region, owning a reference to it (python_scopes.cpp).
PyObject* newForwardScope(c10::intrusive_ptr<RegionHandle> handle);

}  // namespace python
}  // namespace sac
