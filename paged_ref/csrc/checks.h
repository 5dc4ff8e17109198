// The argument checks every native op runs first (paged_ref.native.build compiles this before each source):
// each failure is a c10::Error (RuntimeError in Python) naming the op, the argument, what it must be and what
// it is.
#include <torch/extension.h>
#include <algorithm>
#include <vector>

// t a strided CPU tensor of `dtype` with `dim` dimensions (`layout` names them, as "[n, Hq, D]"), its memory holding
// its values: every element within its storage, not a zero tensor (no memory) nor a negative view (whose values are
// those in memory negated); not one autograd records while it does (the ops have no backward: a gradient through
// one would be missing, with no error).
static inline void check_tensor(const char* op, const char* name, const torch::Tensor& t, at::ScalarType dtype,
                                int64_t dim, const char* layout) {
  TORCH_CHECK(t.defined(), op, ": ", name, " must be a tensor, got None");
  TORCH_CHECK(!t.is_nested(), op, ": ", name, " must be a dense tensor, got a nested tensor");
  TORCH_CHECK(t.device().is_cpu() && t.layout() == at::kStrided, op, ": ", name,
              " must be a dense CPU tensor, got device ", t.device(), ", layout ", t.layout());
  TORCH_CHECK(!t.requires_grad() || !at::GradMode::is_enabled(), op, ": ", name, " requires grad and the op has ",
              "no backward: call it under torch.no_grad() or torch.inference_mode(), or pass ", name, ".detach()");
  TORCH_CHECK(!t._fw_grad(/*level=*/0).defined(), op, ": ", name, " has a forward-mode gradient (a dual tensor of ",
              "torch.autograd.forward_ad) and the op computes none: pass the primal, fwAD.unpack_dual(", name,
              ").primal");
  TORCH_CHECK(!t._is_zerotensor(), op, ": ", name, " must hold its values in memory, got a zero tensor (",
              "torch._efficientzerotensor: no memory)");
  if (t.numel() > 0) {  // its last element in its storage (which can shrink after t is made: untyped_storage().resize_)
    int64_t last = t.storage_offset();  // in elements
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    const bool memory = t.has_storage() && t.storage().data() != nullptr;
    const int64_t room = memory ? static_cast<int64_t>(t.storage().nbytes()) / t.itemsize() : 0;
    TORCH_CHECK(last < room, op, ": ", name, " must lie within its storage, got shape ", t.sizes(), ", strides ",
                t.strides(), ", offset ", t.storage_offset(), " reaching element ", last, " of a storage of ", room,
                " elements (resized after the tensor was made?)");
    const auto address = reinterpret_cast<uintptr_t>(t.data_ptr());  // read as its elements: at their alignment
    TORCH_CHECK(address % t.itemsize() == 0, op, ": ", name, " must start at a multiple of its element size (",
                t.itemsize(), " bytes), got an address ", address % t.itemsize(), " bytes past one (a view of ",
                "unaligned bytes, as torch.frombuffer at an odd offset makes): pass ", name, ".clone()");
  }
  TORCH_CHECK(!t.is_neg(), op, ": ", name, " must hold its own values (read as they lie in memory), got a negative ",
              "view (x.conj().imag is one): pass it through resolve_neg()");
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(dim < 0 || t.dim() == dim, op, ": ", name, " must be ", layout, " (", dim, " dimensions), got shape ",
              t.sizes());
}

// No two elements of t share memory (a sufficient test: the dimensions sorted by stride each step past the
// ones before), so a kernel writing t in place writes each element once.
static inline void check_no_overlap(const char* op, const char* name, const torch::Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of dimensions longer than 1
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  std::sort(dims.begin(), dims.end());
  int64_t reach = 1;  // elements spanned by the dimensions so far
  bool ok = true;
  for (auto [stride, size] : dims) {
    ok = ok && stride >= reach;
    reach = stride * size;
  }
  TORCH_CHECK(t.numel() == 0 || ok, op, ": ", name, " is written in place and must not overlap itself, got shape ",
              t.sizes(), ", strides ", t.strides());
}

// The checks `check` runs, `times` times over (an op's *_checks entry: bench serve --profile divides the time of a
// call by `times`, so that one call's dispatch does not count). The barrier keeps each round's reads in it.
template <typename F>
static inline void repeat_checks(int64_t times, F check) {
  TORCH_CHECK(times >= 0 && times <= 1000000, "checks: times must be in [0, 1000000], got ", times);
  for (int64_t i = 0; i < times; ++i) {
    check();
    asm volatile("" ::: "memory");
  }
}
