// The only file that includes pybind: exposes the C++ core as bagua_lite._C.
// torch/csrc/utils/pybind.h declares c10::intrusive_ptr as a pybind holder, so a Python
// torch.distributed ProcessGroup arrives here as c10::intrusive_ptr<c10d::ProcessGroup>. Every entry
// that communicates releases the GIL for its whole duration.
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

#include "alloc_watch.h"
#include "crash_trace.h"
#include "collectives/collectives.h"
#include "common.h"
#include "engine/engine.h"
#include "kernels/compress.h"
#include "kernels/cuda.h"
#include "kernels/sparse.h"
#include "kernels/topk.h"

namespace py = pybind11;
namespace bl = bagua_lite;
namespace coll = bagua_lite::collectives;
namespace kern = bagua_lite::kernels;
namespace eng = bagua_lite::engine;

namespace {
// An op written in Python (a callable taking the bucket's flat tensor). It runs on the engine thread
// with the GIL held only while Python code runs; torch and bagua_lite calls inside release it again.
class PyOp final : public eng::Op {
 public:
  explicit PyOp(py::object fn) : fn_(new py::object(std::move(fn))) {
    py::gil_scoped_acquire gil;
    name_ = py::str(py::getattr(*fn_, "__name__", py::str("python_op")));
  }
  ~PyOp() override {
    // During interpreter shutdown a non-Python thread must not take the GIL (CPython would end the
    // thread mid-destructor); the callable is leaked then, as the process is going away anyway.
    if (!Py_IsInitialized() || _Py_IsFinalizing()) return;
    py::gil_scoped_acquire gil;
    delete fn_;
  }
  void run(at::Tensor& bucket) override {
    py::gil_scoped_acquire gil;
    (*fn_)(bucket);
  }
  std::string name() const override { return name_; }

 private:
  py::object* fn_;
  std::string name_;
};

// Deleter for the C++ objects Python owns that may own a process group (the native ops) or a thread (the
// engine): they are destroyed without the GIL, as torch destroys its ProcessGroup objects. The last
// reference to a gloo backend joins its worker threads, and such a thread may need the GIL to release a
// tensor whose Python object is gone; holding the GIL across that join would deadlock (or, during
// interpreter finalization, end that thread in std::terminate).
template <typename T>
struct DeleteWithoutGil {
  void operator()(T* p) const {
    if (Py_IsInitialized() && PyGILState_Check()) {
      py::gil_scoped_release nogil;
      delete p;
    } else {
      delete p;
    }
  }
};

template <typename T, typename... Args>
std::shared_ptr<T> make_without_gil_deleter(Args&&... args) {
  return std::shared_ptr<T>(new T(std::forward<Args>(args)...), DeleteWithoutGil<T>());
}

std::vector<eng::OpPtr> to_ops(const py::list& items) {
  std::vector<eng::OpPtr> ops;
  for (const auto& item : items) {
    if (py::isinstance<eng::Op>(item)) {
      ops.push_back(item.cast<eng::OpPtr>());
    } else if (PyCallable_Check(item.ptr())) {
      ops.push_back(std::make_shared<PyOp>(py::reinterpret_borrow<py::object>(item)));
    } else {
      throw py::type_error("bagua_lite engine: an op must be a bagua_lite._C.Op or a callable taking the bucket "
                           "tensor, got " + std::string(py::str(py::type::of(item))));
    }
  }
  return ops;
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "bagua_lite C++ core: kernels and collectives over torch.distributed process groups";
  using release = py::call_guard<py::gil_scoped_release>;

  // ---- kernels ----
  m.def("topk", &kern::topk, "Exact top-k by magnitude; int32 indices ascending", py::arg("x"), py::arg("k"),
        release());
  m.def(
      "topk_out",
      [](const at::Tensor& x, int64_t k, at::Tensor values, at::Tensor indices, std::optional<at::Tensor> block_max) {
        kern::topk_out(x, k, values, indices, block_max ? *block_max : at::Tensor());
      },
      py::arg("x"), py::arg("k"), py::arg("values"), py::arg("indices"), py::arg("block_max") = py::none(), release());
  m.def("compress", &kern::compress, py::arg("x"), py::arg("compression"), release());
  m.def("cuda_kernels_enabled", &kern::cuda::enabled,
        "Whether this build has the CUDA kernels and BAGUA_LITE_CUDA_KERNELS is not 0");
  m.def("cuda_handles_codec", &kern::cuda::handles_codec, py::arg("values"),
        "Whether the CUDA codec kernels take this tensor (float32/16/bf16 on a CUDA device, kernels enabled)");
  m.def(
      "compress_with_residual",
      [](at::Tensor x, const std::string& compression, at::Tensor residual, at::Tensor out) {
        return kern::get_compressor(compression).compress_with_residual(x, residual, out);
      },
      py::arg("x"), py::arg("compression"), py::arg("residual"), py::arg("out"), release(),
      "Error feedback fused on the device (x += residual; out = C(x); residual = x - D(out)); False where "
      "there is no fused path for these tensors (nothing touched)");
  m.def(
      "absmax_encode_cuda",
      [](const at::Tensor& x, at::Tensor header, at::Tensor codes, int64_t bits) {
#ifdef BAGUA_LITE_WITH_CUDA
        kern::cuda::absmax_encode(x, header, codes, bits);
#else
        TORCH_CHECK(false, "absmax_encode_cuda: this build of bagua_lite has no CUDA kernels");
#endif
      },
      py::arg("x"), py::arg("header"), py::arg("codes"), py::arg("bits"), release());
  m.def(
      "absmax_decode_cuda",
      [](const at::Tensor& header, const at::Tensor& codes, at::Tensor out, int64_t bits, bool accumulate) {
#ifdef BAGUA_LITE_WITH_CUDA
        kern::cuda::absmax_decode(header, codes, out, bits, accumulate);
#else
        TORCH_CHECK(false, "absmax_decode_cuda: this build of bagua_lite has no CUDA kernels");
#endif
      },
      py::arg("header"), py::arg("codes"), py::arg("out"), py::arg("bits"), py::arg("accumulate"), release());
  m.def("absmax_encode_cpu", &kern::absmax_encode_cpu, py::arg("x"), py::arg("header"), py::arg("codes"),
        py::arg("bits"), release());
  m.def("absmax_decode_cpu", &kern::absmax_decode_cpu, py::arg("header"), py::arg("codes"), py::arg("out"),
        py::arg("bits"), py::arg("accumulate"), release());
  m.def("decompress", &kern::decompress, py::arg("wire"), py::arg("compression"), py::arg("numel"),
        py::arg("dtype"), release());
  m.def("wire_bytes", [](const std::string& c, int64_t n) { return kern::get_compressor(c).wire_bytes(n); });
  m.def("sparse_normalize", &kern::sparse_normalize, py::arg("values"), py::arg("indices"), release());
  m.def("merge_topk", &kern::merge_topk, py::arg("av"), py::arg("ai"), py::arg("bv"), py::arg("bi"), py::arg("k"),
        release());
  m.def("scatter_add_", [](at::Tensor dense, const at::Tensor& v, const at::Tensor& i) { kern::scatter_add_(dense, v, i); },
        py::arg("dense"), py::arg("values"), py::arg("indices"), release());
  m.def("ef_remove_",
        [](at::Tensor r, const at::Tensor& i, std::optional<at::Tensor> kept) {
          kern::ef_remove_(r, i, kept ? *kept : at::Tensor());
        },
        py::arg("residual"), py::arg("indices"), py::arg("kept") = py::none(), release());
  m.def("all_finite", &kern::all_finite, py::arg("x"), release());
  m.def("scale_checked",
        [](at::Tensor dst, std::optional<at::Tensor> src, double scale) {
          return kern::scale_checked(dst, src ? *src : at::Tensor(), scale);
        },
        py::arg("dst"), py::arg("src"), py::arg("scale") = 1.0, release());
  m.def("copy_flagged_", [](at::Tensor dst, const at::Tensor& src, const at::Tensor& flags) {
          kern::copy_flagged_(dst, src, flags);
        },
        py::arg("dst"), py::arg("src"), py::arg("flags"), release());
  m.def("scale_flagged_",
        [](at::Tensor dst, std::optional<at::Tensor> src, double scale, at::Tensor flag) {
          kern::scale_flagged_(dst, src ? *src : at::Tensor(), scale, flag);
        },
        py::arg("dst"), py::arg("src"), py::arg("scale"), py::arg("flag"), release());
  m.def(
      "add_checked",
      [](at::Tensor out, const at::Tensor& a, const at::Tensor& b, std::optional<at::Tensor> block_max,
         int64_t block_offset) {
        return kern::add_checked(out, a, b, block_max ? *block_max : at::Tensor(), block_offset);
      },
      py::arg("out"), py::arg("a"), py::arg("b"), py::arg("block_max") = py::none(), py::arg("block_offset") = 0,
      release());
  m.def("_topk_last_path", &kern::detail::topk_last_path,
        "test hook: which CPU path this thread's last topk took (1 trivial, 2 sampled threshold, 3/4 exact "
        "fallbacks, 5 block maxima)");
  m.def(
      "block_max_combine_", [](at::Tensor bm, const at::Tensor& x, int64_t lo) { kern::block_max_combine_(bm, x, lo); },
      py::arg("block_max"), py::arg("x"), py::arg("block_offset"), release());
  m.def(
      "momentum_add_checked",
      [](at::Tensor u_out, at::Tensor acc_out, const at::Tensor& u, const at::Tensor& residual,
         std::optional<at::Tensor> g, double m, std::optional<at::Tensor> w, double wd,
         std::optional<at::Tensor> block_max, int64_t block_offset) {
        return kern::momentum_add_checked(u_out, acc_out, u, residual, g ? *g : at::Tensor(), m, w ? *w : at::Tensor(),
                                          wd, block_max ? *block_max : at::Tensor(), block_offset);
      },
      py::arg("u_out"), py::arg("acc_out"), py::arg("u"), py::arg("residual"), py::arg("g"), py::arg("m"),
      py::arg("w") = py::none(), py::arg("wd") = 0.0, py::arg("block_max") = py::none(), py::arg("block_offset") = 0,
      release());

  m.def(
      "add_flagged_",
      [](at::Tensor out, const at::Tensor& a, const at::Tensor& b, std::optional<at::Tensor> block_max,
         int64_t block_offset, at::Tensor flag) {
        kern::add_flagged_(out, a, b, block_max ? *block_max : at::Tensor(), block_offset, flag);
      },
      py::arg("out"), py::arg("a"), py::arg("b"), py::arg("block_max"), py::arg("block_offset"), py::arg("flag"),
      release());
  m.def(
      "momentum_add_flagged_",
      [](at::Tensor u_out, at::Tensor acc_out, const at::Tensor& u, const at::Tensor& residual,
         std::optional<at::Tensor> g, double m, std::optional<at::Tensor> w, double wd,
         std::optional<at::Tensor> block_max, int64_t block_offset, at::Tensor flag) {
        kern::momentum_add_flagged_(u_out, acc_out, u, residual, g ? *g : at::Tensor(), m, w ? *w : at::Tensor(), wd,
                                    block_max ? *block_max : at::Tensor(), block_offset, flag);
      },
      py::arg("u_out"), py::arg("acc_out"), py::arg("u"), py::arg("residual"), py::arg("g"), py::arg("m"),
      py::arg("w"), py::arg("wd"), py::arg("block_max"), py::arg("block_offset"), py::arg("flag"), release());

  m.def(
      "sparse_sgd_step_",
      [](const std::vector<at::Tensor>& params, const std::vector<int64_t>& offsets, const at::Tensor& flat,
         const at::Tensor& indices, const std::vector<double>& lrs) {
        kern::sparse_sgd_step_(params, offsets, flat, indices, lrs);
      },
      py::arg("params"), py::arg("offsets"), py::arg("flat"), py::arg("indices"), py::arg("lrs"), release());

  // ---- collectives ----
  m.def("allreduce", [](const bl::ProcessGroupPtr& pg, at::Tensor t, bool avg) { coll::allreduce(pg, t, avg); },
        py::arg("pg"), py::arg("t"), py::arg("average"), release());
  m.def("broadcast", [](const bl::ProcessGroupPtr& pg, at::Tensor t, int64_t src) { coll::broadcast(pg, t, src); },
        py::arg("pg"), py::arg("t"), py::arg("src"), release());
  m.def("compressed_allreduce",
        [](const bl::ProcessGroupPtr& pg, at::Tensor t, const std::string& c, bool avg,
           std::optional<at::Tensor> residual) { coll::compressed_allreduce(pg, t, c, avg, residual); },
        py::arg("pg"), py::arg("t"), py::arg("compression"), py::arg("average"), py::arg("residual") = py::none(),
        release());
  m.def("compress_into",
        [](const at::Tensor& x, const std::string& c, at::Tensor out) {
          bl::check_floating(x, "compress_into", "x");
          bl::check_contiguous(x, "compress_into", "x");
          kern::get_compressor(c).compress(x, out);
        },
        py::arg("x"), py::arg("compression"), py::arg("out"), release());
  m.def("decompress_into",
        [](const at::Tensor& wire, const std::string& c, at::Tensor out, bool accumulate) {
          bl::check_floating(out, "decompress_into", "out");
          bl::check_contiguous(out, "decompress_into", "out");
          kern::get_compressor(c).decompress(wire, out, accumulate);
        },
        py::arg("wire"), py::arg("compression"), py::arg("out"), py::arg("accumulate"), release());
  m.def("gossip_fold",
        [](const std::string& c, const at::Tensor& own, const std::vector<at::Tensor>& received, at::Tensor x_hat,
           at::Tensor nbr_sum, at::Tensor delta, double degree) {
          return kern::gossip_fold(c, own, received, x_hat, nbr_sum, delta, degree);
        },
        py::arg("compression"), py::arg("own"), py::arg("received"), py::arg("x_hat"), py::arg("nbr_sum"),
        py::arg("delta"), py::arg("degree"), release());
  m.def("sparse_allreduce", &coll::sparse_allreduce, py::arg("pg"), py::arg("values"), py::arg("indices"),
        py::arg("numel"), py::arg("out") = py::none(), release());
  m.def("sparse_allgather", &coll::sparse_allgather, py::arg("pg"), py::arg("values"), py::arg("indices"),
        py::arg("k") = -1, py::arg("out_values") = py::none(), py::arg("out_indices") = py::none(),
        py::arg("verify") = true, release());
  m.def("gtopk_allreduce", &coll::gtopk_allreduce, py::arg("pg"), py::arg("values"), py::arg("indices"), py::arg("k"),
        py::arg("exact"), py::arg("numel") = -1, py::arg("value_bits") = 0,
        py::arg("final_union") = false, py::arg("out_values") = py::none(), py::arg("out_indices") = py::none(),
        py::arg("canonical") = false, release());
  m.def("shift_one_partner", &coll::shift_one_partner, py::arg("rank"), py::arg("size"), py::arg("step"));

  // ---- engine ----
  py::class_<eng::Op, eng::OpPtr>(m, "Op")
      .def_property_readonly("name", &eng::Op::name)
      .def("run", [](eng::Op& op, at::Tensor bucket) { op.run(bucket); }, py::arg("bucket"), release(),
           "Run the op on a flat bucket tensor now, on the calling thread (the engine normally does this).");
  py::class_<eng::AllreduceOp, eng::Op, std::shared_ptr<eng::AllreduceOp>>(m, "AllreduceOp")
      .def(py::init([](bl::ProcessGroupPtr pg, bool average) {
             return make_without_gil_deleter<eng::AllreduceOp>(std::move(pg), average);
           }),
           py::arg("pg"), py::arg("average"));
  py::class_<eng::CompressedAllreduceOp, eng::Op, std::shared_ptr<eng::CompressedAllreduceOp>>(m, "CompressedAllreduceOp")
      .def(py::init([](bl::ProcessGroupPtr pg, std::string compression, bool average,
                       std::optional<at::Tensor> residual) {
             return make_without_gil_deleter<eng::CompressedAllreduceOp>(std::move(pg), std::move(compression),
                                                                         average, std::move(residual));
           }),
           py::arg("pg"), py::arg("compression"), py::arg("average"), py::arg("residual") = py::none());
  py::class_<eng::Engine, std::shared_ptr<eng::Engine>>(m, "Engine")
      .def(py::init([] { return eng::Engine::track(make_without_gil_deleter<eng::Engine>()); }))
      .def("submit",
           [](eng::Engine& e, int64_t id, at::Tensor bucket, const py::list& ops) {
             auto native = to_ops(ops);
             py::gil_scoped_release nogil;
             e.submit(id, std::move(bucket), std::move(native));
           },
           py::arg("bucket_id"), py::arg("bucket"), py::arg("ops"))
      .def("wait_all", &eng::Engine::wait_all, release())
      .def("wait_all_for", &eng::Engine::wait_all_for, py::arg("seconds"), release())
      .def("abandon",
           [](std::shared_ptr<eng::Engine> self) {
             new std::shared_ptr<eng::Engine>(self);  // never freed: the detached worker still uses it
             py::gil_scoped_release no_gil;
             self->abandon();
           })
      .def("shutdown", &eng::Engine::shutdown, release())
      .def("stats",
           [](eng::Engine& e) {
             auto s = e.stats();
             return py::dict(py::arg("buckets_done") = s.buckets_done, py::arg("busy_seconds") = s.busy_seconds);
           })
      .def("reset_stats", &eng::Engine::reset_stats);
  m.def("_stop_engines_for_exit", &eng::Engine::stop_all_for_exit, py::arg("seconds"), release(),
        "At process exit (bagua_lite.runtime's atexit hook): every live engine starts no further op and its "
        "worker is joined once it has left the op or collective it is in, waiting at most `seconds` in all. "
        "Returns how many workers are still running (left to the process's end).");
  m.def("_engines_created", &eng::Engine::created, "How many engines this process has made.");
  m.def("serial_intra_op_here", &bl::serial_intra_op_here,
        "Makes ATen's intra-op work on the calling thread serial (no OpenMP team of its own), as the engine's "
        "thread runs: for a thread bagua_lite runs beside training. Only this thread's count changes.");

  // ---- traffic counters ----
  m.def("bytes_sent", [] { return bl::traffic().bytes_sent.load(); });
  m.def("messages_sent", [] { return bl::traffic().messages.load(); });
  m.def("count_sent", [](int64_t bytes, int64_t messages) { bl::count_sent(bytes, messages); }, py::arg("bytes"),
        py::arg("messages"), "Count traffic sent from Python with torch.distributed (p2p weight exchanges).");
  m.def("_alloc_watch_start", &bl::alloc_watch_start, py::arg("min_bytes"), py::arg("traces") = false,
        "Tests: record every CPU allocation of at least min_bytes, from any thread, until _alloc_watch_stop "
        "(traces: with each one's C++ backtrace).");
  m.def("_alloc_watch_pause", &bl::alloc_watch_pause, py::arg("paused"),
        "Tests: pause (True) or resume (False) the running watch, for every thread.");
  m.def("_alloc_watch_stop", &bl::alloc_watch_stop,
        "Tests: stop the watch; the sizes it recorded, in order, and their backtraces (empty without traces).");
  m.def("_install_crash_trace", &bl::install_crash_trace,
        "Tests: on SIGSEGV, SIGBUS, SIGILL, SIGFPE or SIGABRT, write the crashing thread's native backtrace to "
        "stderr, then hand the signal to the handler installed before (faulthandler's). False if installed already.");
  m.def("reset_traffic", [] {
    bl::traffic().bytes_sent = 0;
    bl::traffic().messages = 0;
  });
}
