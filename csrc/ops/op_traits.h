#pragma once
// What the policy needs to know about an op overload, read once from its schema and tags.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace c10 {
class OperatorHandle;
struct IValue;
}  // namespace c10

namespace sac {

struct OpTraits {
  std::string qualified_name;  // "aten::tanh" for the default overload, "aten::add.Tensor" otherwise
  std::string base_name;       // "aten::add": what "every overload" spellings match
  std::string ns;              // "aten", "c10d", ...

  // Collectives are never kept: eliding one in the recompute would desynchronise ranks or
  // leave a destination buffer that another rank fills uninitialised.
  bool is_collective = false;
  // Ops tagged nondeterministic_seeded draw from a generator. They are never kept: skipping
  // one in the recompute would shift the generator for every random op after it.
  bool is_random = false;
  // Attention kernels are tagged random because they may apply dropout, but draw nothing when
  // dropout_p == 0. The index of that argument, or -1: such an op is random only per call.
  int dropout_p_argument = -1;
  // Its result depends on the values of its inputs in a way the host sees (`.item()`, nonzero's
  // output size: tagged data_dependent_output or dynamic_output_shape), so the code after it may
  // differ between ranks (NOTE: [The recompute runs only what backward needs] in
  // dispatch/dead_calls.cpp).
  bool reads_values_on_host = false;
  // Writes an input that is not an out= argument (in-place ops, c10d's in-place collectives).
  bool mutates_inputs = false;
  // Writes only its out= arguments; for the policy it behaves like the functional op.
  bool writes_out_arguments = false;
  // The arguments the op writes, in schema order: those its schema annotates as written, and
  // those NOTE: [Writes no schema declares] names (unannotatedWrites).
  std::vector<uint32_t> written_arguments;
  // Their names in the schema ("running_mean"), in the same order, for messages.
  std::vector<std::string> written_argument_names;
  // Returns an alias of an input. Keeping a view pins its base and breaks aliasing in the
  // recompute, while recomputing it costs nothing, so units never keep views.
  bool is_view = false;
  // Passed straight through, never counted: detach, prim::device, metadata queries,
  // profiler bookkeeping and this plugin's own ops.
  bool never_counts = false;
  // Allocates memory it leaves uninitialised (aten::empty, empty_like, new_empty, empty_strided,
  // new_empty_strided, every overload). Keeping one is useless: its contents are garbage until
  // its first write, and what a kept output would hold from before that write (NOTE: [Kept
  // outputs written in the forward] in preserved_writes.cpp) is the garbage, so such calls are never kept.
  bool is_uninitialised_allocation = false;
  // aten::_to_copy: when it casts a parameter (autocast's weight casts) it is never kept, see
  // castsAParameter.
  bool is_copy_cast = false;
  // One of the ops every call of which routes tokens (isRoutingOp in routing.h), read once here
  // rather than by name on every call.
  bool is_routing = false;
  // Returns its argument wrapped in a tensor subclass and computes nothing (functional
  // collectives' _wrap_tensor_autograd, which makes the AsyncCollectiveTensor a wait_tensor later
  // unwraps): it reads no value, so what it wraps is needed only if what it returns is (NOTE:
  // [The recompute runs only what backward needs] in dispatch/dead_calls.cpp).
  bool only_wraps = false;
  // aten::lift_fresh, which torch calls on every constant it builds from Python values (NOTE: [A
  // small constant is named by its value] in dispatch/data_flow.cpp).
  bool is_lift_fresh = false;
};

OpTraits classifyOp(const c10::OperatorHandle& op);

// NOTE: [Writes no schema declares]
// An op's schema marks the arguments it writes with an alias annotation (`Tensor(a!) self`), and
// every write the plugin sees is read from those marks: what a kept output written in the forward
// preserves, and how the data flow names a storage after a write. c10d's in-place collectives
// (`c10d::allreduce_(Tensor[] tensors, ...)`, which `dist.all_reduce(t)` calls) and a few other ops
// write their tensor arguments without the mark. Unseen, such a write corrupts gradients in
// silence: a kept `mm` whose output the forward then all-reduces in place (row-parallel tensor
// parallelism) would be served the reduced value, and reduced again in the recompute. So every op
// registered without marks whose name says it writes (the c10d namespace, a trailing underscore)
// is listed here with the arguments it writes, or with none where it writes nothing (barriers, a
// NaN check); a test checks every such op registered in the running torch against this table.
// Batch norm's forwards that update the running statistics without marking them are listed too,
// by name (NOTE: [The recompute writes nothing outside its region] in dispatch/outside_writes.cpp).
struct UnannotatedWrite {
  std::string_view op;                    // base name: every overload
  std::vector<std::string_view> written;  // argument names; empty: writes nothing
};
const std::vector<UnannotatedWrite>& unannotatedWrites();

// Whether an op's name says it writes (c10d's namespace, or a trailing underscore) although its
// schema marks no argument as written: such an op must be in unannotatedWrites().
bool namedAsWritingWithoutMarks(const c10::OperatorHandle& op);

// The ops (base names, every overload) that are never counted; the native path lets them skip
// the key (NOTE: [Calls that never count skip the key] in fallback.cpp).
std::vector<std::string> neverCountedOpNames();

// NOTE: [A call's facts are decided here]
// Two facts about a single call, beyond what its op is, feed the keep rule (sac::CallFacts):
// whether it draws random numbers and whether it casts a parameter. The engines read the call's
// arguments on the dispatcher stack; torch.compile's policy function and the dispatch-mode engine
// see them as Python values (bindings/python_queries.cpp). Each front door only reads the values
// the rule needs and hands them to the two functions below, which state the rule once over them,
// so no front door can tell a call apart differently. The dispatcher gives dropout_p as a double;
// Python gives what the caller wrote, where an int 0 draws nothing just as 0.0 does.

// Whether a call draws from a generator: a random op, unless it takes a dropout_p
// (randomOnlyPerCall) and the call's is 0. `dropout_p`: the call's value of that argument as a
// number, nullopt when it is none (a symbolic value, whose draw cannot be ruled out); read only
// for an op that takes one.
bool drawsRandomNumbers(const OpTraits& traits, std::optional<double> dropout_p);
// The same from the dispatcher stack: `arguments` points at the call's first argument.
bool drawsRandomNumbers(const OpTraits& traits, const c10::IValue* arguments);

// NOTE: [Autocast's weight casts]
// Autocast caches the cast of a parameter (a leaf that requires grad) for as long as its
// context is open. The forward and the recompute open different contexts, so a cast that hit
// the cache in the forward (the weight was cast earlier, outside the region) misses it in the
// recompute, and runs there only: a kept cast would then be matched to another weight's cast of
// the same shape. Casting a parameter is cheap and its input is always at hand, so such calls
// are never kept.
//
// Whether a call casts a parameter: an aten::_to_copy whose source (its first argument) is a
// leaf that requires grad (a source that is no tensor: false, false).
bool castsAParameter(const OpTraits& traits, bool source_requires_grad, bool source_is_leaf);
// The same from the dispatcher stack: `arguments` points at the call's first argument.
bool castsAParameter(const OpTraits& traits, const c10::IValue* arguments);

// A random op that can still be kept when it draws nothing (dropout_p == 0).
inline bool randomOnlyPerCall(const OpTraits& traits) { return traits.is_random && traits.dropout_p_argument >= 0; }

// "aten::add.Tensor" / "aten::tanh" for a schema name and overload name.
std::string qualifiedOpName(const std::string& name, const std::string& overload);

}  // namespace sac
