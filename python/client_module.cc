// moed._client: the expert service's C++ client (moe::client::Session) for
// Python (docs/serving.md#python). Rows travel as contiguous byte buffers in
// the job's dtype (fp32, or bf16 as 16-bit words); every call releases the GIL,
// so threads of one program overlap their calls.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <google/protobuf/util/json_util.h>

#include <cstring>
#include <optional>

#include "moe/client/session.h"
#include "moe/rpc/local_access.h"

namespace py = pybind11;
using moe::client::Session;
using moe::client::SessionOptions;

namespace {

moe::v1::JobSpec::DType dtype_of(const std::string& name) {
  moe::v1::JobSpec::DType d;
  if (!moe::v1::JobSpec::DType_Parse(name, &d) || d == moe::v1::JobSpec::DTYPE_UNSPECIFIED)
    throw moe::InvalidArgument("dtype: fp32 or bf16, got '" + name + "'");
  return d;
}

// A C-contiguous buffer of rows x hidden values of the dtype.
struct Rows {
  const void* data;
  int64_t rows;
};
Rows rows_of(const py::buffer& b, int hidden, const std::string& dtype) {
  const py::buffer_info info = b.request();
  const int64_t value_bytes = dtype == "bf16" ? 2 : 4;
  const int64_t bytes = info.size * info.itemsize;
  if (info.ndim > 0 && info.strides.back() != info.itemsize)
    throw moe::InvalidArgument("x: the rows must be contiguous");
  if (hidden < 1 || bytes % (hidden * value_bytes) != 0)
    throw moe::InvalidArgument("x: " + std::to_string(bytes) + " bytes are not whole rows of " +
                               std::to_string(hidden) + " " + dtype + " values");
  return {info.ptr, bytes / (hidden * value_bytes)};
}

py::array_t<uint8_t> to_array(std::vector<uint8_t> v) {
  auto* owner = new std::vector<uint8_t>(std::move(v));
  py::capsule free_it(owner, [](void* p) { delete static_cast<std::vector<uint8_t>*>(p); });
  return py::array_t<uint8_t>({static_cast<py::ssize_t>(owner->size())}, owner->data(), free_it);
}

py::array_t<float> floats_of(const std::string& bytes) {
  py::array_t<float> a(static_cast<py::ssize_t>(bytes.size() / sizeof(float)));
  std::memcpy(a.mutable_data(), bytes.data(), bytes.size());
  return a;
}

std::unique_ptr<Session> open_session(const std::string& job, std::optional<std::string> agent,
                                      std::optional<std::string> token, std::optional<std::string> state_dir,
                                      std::optional<std::tuple<std::string, std::string, std::string>> tls,
                                      const std::string& name, double timeout_s, std::optional<size_t> wire_min_bytes) {
  SessionOptions o;
  const moe::rpc::LocalAccess local = moe::rpc::local_access(state_dir.value_or(moe::rpc::default_state_dir()));
  o.agent = agent.value_or(local.agent);
  if (o.agent.empty())
    throw moe::InvalidArgument("agent: no HOST:PORT given and no cluster is up in " +
                               state_dir.value_or(moe::rpc::default_state_dir()));
  o.token = token.value_or(local.token);
  o.tls = tls ? moe::rpc::TlsFiles{std::get<0>(*tls), std::get<1>(*tls), std::get<2>(*tls)} : local.tls;
  o.job = job;
  o.name = name;
  o.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  if (wire_min_bytes) o.wire_min_bytes = *wire_min_bytes;
  py::gil_scoped_release unlocked;
  return std::make_unique<Session>(std::move(o));
}

}  // namespace

PYBIND11_MODULE(_client, m) {
  m.doc() = "The expert service's client (docs/serving.md): calls of a serving job's layers.";
  py::register_exception<moe::rpc::RpcError>(m, "RpcError", PyExc_RuntimeError);
  py::register_exception<moe::InvalidArgument>(m, "InvalidArgument", PyExc_ValueError);

  py::class_<Session::Handle>(m, "Handle")
      .def_readonly("node", &Session::Handle::node)
      .def_readonly("id", &Session::Handle::id)
      .def_readonly("layer", &Session::Handle::layer)
      .def_readonly("rows", &Session::Handle::rows);

  py::class_<Session>(m, "Session")
      .def(py::init(&open_session), py::arg("job"), py::arg("agent") = py::none(), py::arg("token") = py::none(),
           py::arg("state_dir") = py::none(), py::arg("tls") = py::none(), py::arg("name") = "python",
           py::arg("timeout_s") = 30.0, py::arg("wire_min_bytes") = py::none())
      .def_property_readonly("hidden", &Session::hidden)
      .def_property_readonly("layers", &Session::layers)
      .def_property_readonly("dtype", [](const Session& s) { return moe::v1::JobSpec::DType_Name(s.spec().dtype()); })
      .def_property_readonly("trains", [](const Session& s) { return s.spec().serve_train(); })
      .def_property_readonly("steps", &Session::steps)
      .def("forward",
           [](Session& s, int layer, const py::buffer& x, const std::string& dtype, bool keep) -> py::object {
             const Rows r = rows_of(x, s.hidden(), dtype);
             Session::Kept out;
             {
               py::gil_scoped_release unlocked;
               if (keep) out = s.forward_kept(layer, r.data, r.rows, dtype_of(dtype));
               else out.y = s.forward_bytes(layer, r.data, r.rows, dtype_of(dtype));
             }
             if (!keep) return to_array(std::move(out.y));
             return py::make_tuple(to_array(std::move(out.y)), out.handle);
           },
           py::arg("layer"), py::arg("x"), py::arg("dtype"), py::arg("keep_for_backward") = false,
           "The layer's output bytes for rows x; with keep_for_backward, (output, handle).")
      .def("backward",
           [](Session& s, const Session::Handle& h, const py::buffer& grad_y, const std::string& dtype) {
             const Rows r = rows_of(grad_y, s.hidden(), dtype);
             if (r.rows != h.rows)
               throw moe::InvalidArgument("grad_y: " + std::to_string(r.rows) + " rows for a handle of " +
                                          std::to_string(h.rows));
             std::vector<uint8_t> g;
             {
               py::gil_scoped_release unlocked;
               g = s.backward_bytes(h, r.data, dtype_of(dtype));
             }
             return to_array(std::move(g));
           },
           py::arg("handle"), py::arg("grad_y"), py::arg("dtype"),
           "The input's gradient bytes for grad_y; the weight gradients add up on the cluster.")
      .def("step",
           [](Session& s, int clients, const std::string& caller) {
             py::gil_scoped_release unlocked;
             return s.step(clients, caller);
           },
           py::arg("clients") = 1, py::arg("caller") = "",
           "One optimizer step once `clients` callers asked; returns the job's steps.")
      .def("weights",
           [](Session& s) {
             moe::v1::ServeWeightsReply w;
             {
               py::gil_scoped_release unlocked;
               w = s.weights();
             }
             py::list layers;
             for (const moe::v1::ServeLayerWeights& l : w.layers()) {
               py::dict d;
               d["gate"] = floats_of(l.gate());
               d["w13"] = floats_of(l.w13());
               d["w2"] = floats_of(l.w2());
               d["shared_w13"] = floats_of(l.shared_w13());
               d["shared_w2"] = floats_of(l.shared_w2());
               d["shared_gate"] = floats_of(l.shared_gate());
               d["selection_bias"] = floats_of(l.selection_bias());
               d["logit_bias"] = floats_of(l.logit_bias());
               layers.append(d);
             }
             return py::make_tuple(w.step(), layers);
           },
           "(steps, [per layer: dict of flat fp32 arrays]): the weights the job computes with.")
      .def("spec_json", [](const Session& s) {
        std::string json;
        google::protobuf::util::JsonPrintOptions o;
        o.preserve_proto_field_names = true;
        o.always_print_primitive_fields = true;
        (void)google::protobuf::util::MessageToJsonString(s.spec(), &json, o);
        return json;
      });
}
