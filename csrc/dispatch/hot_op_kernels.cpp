// Unboxed kernels on the key for the ops a model calls most, on the native path.

#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKeySet.h>

// The generated op structs need the tensor and key set types declared first.
#include <ATen/ops/add_ops.h>
#include <ATen/ops/addmm_ops.h>
#include <ATen/ops/bmm_ops.h>
#include <ATen/ops/cos_ops.h>
#include <ATen/ops/div_ops.h>
#include <ATen/ops/exp_ops.h>
#include <ATen/ops/mm_ops.h>
#include <ATen/ops/mul_ops.h>
#include <ATen/ops/neg_ops.h>
#include <ATen/ops/relu_ops.h>
#include <ATen/ops/rsqrt_ops.h>
#include <ATen/ops/sigmoid_ops.h>
#include <ATen/ops/silu_ops.h>
#include <ATen/ops/sin_ops.h>
#include <ATen/ops/sub_ops.h>
#include <ATen/ops/tanh_ops.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <optional>
#include <tuple>
#include <type_traits>

#include "dispatch/intercepted_call.h"
#include "dispatch/interception.h"
#include "ops/per_thread.h"

namespace sac {
namespace {

// NOTE: [Hot ops skip boxing]
// A backend fallback receives every call boxed: torch copies each argument into a stack of
// IValues. A tensor that Python also holds then has a second owner, and torch takes the GIL to
// retain its Python object (TensorImpl::incref_pyobject) and again to release it when the stack
// lets go: on a block of small ops that is most of what interception costs beside the call
// pipeline itself. So on the native path the ops models call most (matmuls, elementwise
// arithmetic, activations: kHotOps below) get unboxed kernels on the key. Such a kernel runs the
// fallback's steps (InterceptedCall in intercepted_call.h), handing the call pipeline the call's
// arguments as borrowed IValues (no owner added, so nothing is retained) and boxing only the
// outputs, which Python does not hold yet; it runs the kernel below the key unboxed. The
// borrowed arguments are released, never destroyed, whatever way the call ends (BorrowedStack),
// so the pipeline must leave them on the stack: a served call's outputs follow its arguments
// (Region::serve). Every decision, count and served value is the fallback's: only the way the
// call arrives differs. A hot op's call on another owner's tensors passes through uncounted, as
// in the fallback (NOTE: [Calls that are not ours] in fallback.cpp).

// The stacks hot calls build their arguments on, reused call after call on each thread, so that a
// hot call allocates nothing for them. A call that arrives while another is being handled on the
// thread (none does today: kernels run with the key excluded) takes the next one, or a stack of
// its own past the last. A stack is given back to the thread's stacks it was taken from, so a
// call looks them up once (NOTE: [One lookup per thread-local object]).
class ReusedStacks {
 public:
  static ReusedStacks& mine() { return PerThread<ReusedStacks>::get(); }

  torch::jit::Stack* take() { return in_use_ < kReused ? &stacks_[in_use_++] : new torch::jit::Stack(); }
  void give_back(torch::jit::Stack* stack) {
    stack->clear();
    if (in_use_ > 0 && stack == &stacks_[in_use_ - 1]) {
      --in_use_;
    } else {
      delete stack;
    }
  }

 private:
  static constexpr size_t kReused = 4;
  std::array<torch::jit::Stack, kReused> stacks_;
  size_t in_use_ = 0;
};

// The arguments of one call as the call pipeline reads them: tensors borrowed, other values boxed
// as torch boxes them.
class BorrowedStack {
 public:
  template <class... Args>
  explicit BorrowedStack(const Args&... args) : owner_(ReusedStacks::mine()), values_(owner_.take()) {
    values_->reserve(sizeof...(Args) + 1);
    (push(args), ...);
    num_arguments_ = sizeof...(Args);
  }
  BorrowedStack(const BorrowedStack&) = delete;
  BorrowedStack& operator=(const BorrowedStack&) = delete;
  ~BorrowedStack() {
    const size_t borrowed = num_arguments_ + (borrows_result_ ? 1 : 0);
    for (size_t i = 0; i < borrowed && i < values_->size(); ++i) {
      if ((*values_)[i].isTensor()) c10::MaybeOwnedTraits<c10::IValue>::destroyBorrow((*values_)[i]);
    }
    owner_.give_back(values_);
  }

  torch::jit::Stack& values() { return *values_; }

  // The kernel's output, borrowed from the invocation that owns it and outlives this stack: copying
  // it onto the stack would retain and release the new tensor once more per call, two atomic
  // operations that a small op notices.
  void pushBorrowedResult(const at::Tensor& result) {
    push(result);
    borrows_result_ = true;
  }

 private:
  void push(const at::Tensor& tensor) {
    values_->emplace_back(c10::MaybeOwnedTraits<at::Tensor>::createBorrow(tensor));
  }
  void push(const c10::Scalar& scalar) { values_->emplace_back(scalar); }

  ReusedStacks& owner_;
  torch::jit::Stack* values_;
  size_t num_arguments_ = 0;
  bool borrows_result_ = false;
};

// A hot call, seen through two functions of its op: one builds its arguments' stack, one runs its
// kernel below the key. The fallback's steps (InterceptedCall) are thereby compiled once for every
// hot op rather than once per op: a block that calls a dozen different ops runs one copy of them,
// which stays in the instruction cache, where a copy per op crowded it out.
class HotInvocation {
 public:
  using BuildStack = void (*)(const void* arguments, std::optional<BorrowedStack>* stack);
  using Redispatch = at::Tensor (*)(c10::DispatchKeySet below, const void* arguments);

  HotInvocation(const void* arguments, BuildStack build_stack, Redispatch redispatch)
      : arguments_(arguments), build_stack_(build_stack), redispatch_(redispatch) {}

  torch::jit::Stack& arguments() {
    if (C10_UNLIKELY(owned_.has_value())) return *owned_;
    if (!stack_.has_value()) build_stack_(arguments_, &stack_);
    return stack_->values();
  }
  // The arguments as a stack of their own, which the call pipeline may change (NOTE: [The
  // recompute writes nothing outside its region] in outside_writes.cpp): the call then runs boxed.
  torch::jit::Stack& ownedArguments(const c10::OperatorHandle& op) {
    if (!owned_.has_value()) {
      const torch::jit::Stack& borrowed = arguments();
      owned_.emplace(borrowed.begin(), borrowed.end());  // copies own what they hold
      op_ = &op;
    }
    return *owned_;
  }
  void runKernel(c10::DispatchKeySet below) {
    if (C10_UNLIKELY(owned_.has_value())) {
      op_->redispatchBoxed(below, &*owned_);
      result_ = owned_->back().toTensor();
      return;
    }
    result_ = redispatch_(below, arguments_);
    if (stack_.has_value()) stack_->pushBorrowedResult(result_);
  }
  void served(size_t /*num_arguments*/, size_t /*num_returns*/) {
    torch::jit::Stack& values = owned_.has_value() ? *owned_ : stack_->values();
    result_ = std::move(values.back()).toTensor();
    values.pop_back();
  }
  at::Tensor takeResult() { return std::move(result_); }

 private:
  const void* arguments_;  // the op's std::tuple of argument references
  BuildStack build_stack_;
  Redispatch redispatch_;
  at::Tensor result_;  // declared before stack_, so that it outlives the stack's borrow of it
  std::optional<BorrowedStack> stack_;
  std::optional<torch::jit::Stack> owned_;
  const c10::OperatorHandle* op_ = nullptr;
};

// The one copy of the fallback's steps that every hot op runs.
C10_NOINLINE void interceptHotCall(const OpEntry& entry, const c10::OperatorHandle& handle, c10::DispatchKeySet keys,
                                   HotInvocation& invocation) {
  InterceptedCall<HotInvocation>(entry, handle, keys, invocation).run();
}

inline bool carriesOurKey(const at::Tensor& tensor) {
  return tensor.defined() && tensor.unsafeGetTensorImpl()->key_set().has(kSacKey);
}
inline bool carriesOurKey(const c10::Scalar& /*scalar*/) { return false; }

template <class Op, class Schema = typename Op::schema>
struct HotOpKernel;

template <class Op, class... Args>
struct HotOpKernel<Op, at::Tensor(Args...)> {
  static_assert((... && (std::is_same_v<Args, const at::Tensor&> || std::is_same_v<Args, const c10::Scalar&>)),
                "hot ops take tensors and scalars only (BorrowedStack boxes no other kind)");

  using Arguments = std::tuple<Args...>;  // references: Args are const T&

  static at::Tensor call(c10::DispatchKeySet keys, Args... args) {
    if ((... || carriesOurKey(args))) return Op::redispatch(keys & kBelowSacKey, args...);
    const Arguments arguments(args...);
    HotInvocation invocation(&arguments, &buildStack, &redispatch);
    interceptHotCall(entry(), *handle, keys, invocation);
    return invocation.takeResult();
  }

  static void buildStack(const void* arguments, std::optional<BorrowedStack>* stack) {
    std::apply([stack](Args... args) { stack->emplace(args...); }, *static_cast<const Arguments*>(arguments));
  }
  static at::Tensor redispatch(c10::DispatchKeySet below, const void* arguments) {
    return std::apply([below](Args... args) { return Op::redispatch(below, args...); },
                      *static_cast<const Arguments*>(arguments));
  }

  static const OpEntry& entry() {
    const OpEntry* found = cached_entry.load(std::memory_order_acquire);
    if (C10_UNLIKELY(found == nullptr)) {
      found = &lookupOp(*handle);
      cached_entry.store(found, std::memory_order_release);
    }
    return *found;
  }

  static void install(torch::Library& library) {
    handle.emplace(c10::Dispatcher::singleton().findSchemaOrThrow(Op::name, Op::overload_name));
    std::string name = std::string(Op::name).substr(sizeof("aten::") - 1);
    if (*Op::overload_name != '\0') name += std::string(".") + Op::overload_name;
    library.impl(name.c_str(), TORCH_FN(HotOpKernel::call));
  }

  // Set once, before the kernel is registered; aten's ops live as long as the process.
  static inline std::optional<c10::OperatorHandle> handle;
  static inline std::atomic<const OpEntry*> cached_entry{nullptr};
};

template <class... Ops>
void installAll(torch::Library& library) {
  (HotOpKernel<Ops>::install(library), ...);
}

}  // namespace

void installHotOpKernels() {
  // Leaked: the kernels stay registered as long as the process, like the fallback.
  static torch::Library* library =
      new torch::Library(torch::Library::IMPL, "aten", kSacKey, __FILE__, static_cast<uint32_t>(__LINE__));
  installAll<at::_ops::mm, at::_ops::bmm, at::_ops::addmm, at::_ops::add_Tensor, at::_ops::sub_Tensor,
             at::_ops::mul_Tensor, at::_ops::div_Tensor, at::_ops::neg, at::_ops::exp, at::_ops::rsqrt, at::_ops::tanh,
             at::_ops::sigmoid, at::_ops::sin, at::_ops::cos, at::_ops::relu, at::_ops::silu>(*library);
}

}  // namespace sac
