// Fuzz target: what a peer can send the control plane. A frame (4-byte length +
// Envelope) and a JobSpec as JSON must either parse or fail with moe::Error
// (RpcError for a frame, InvalidArgument for a spec).
#include <cstdint>
#include <string>
#include <vector>

#include "moe/rpc/frame.h"
#include "moe/spec/job_spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    if (size >= 4) {
      const uint32_t len = moe::rpc::decode_length(data);
      if (len <= size - 4) {
        const moe::v1::Envelope env = moe::rpc::decode_body(data + 4, len);
        (void)moe::rpc::payload_name(env);
        if (env.has_submit_job()) {
          moe::v1::JobSpec s = env.submit_job().spec();
          s = moe::spec::with_defaults(s);
          moe::spec::validate(s, 4);
        }
      }
    }
  } catch (const moe::Error&) {
  }
  try {
    moe::v1::JobSpec s = moe::spec::spec_from_json(std::string(reinterpret_cast<const char*>(data), size));
    s = moe::spec::with_defaults(s);
    moe::spec::validate(s, 3);
  } catch (const moe::Error&) {
  }
  return 0;
}

std::vector<std::string> fuzz_seeds() {
  moe::v1::Envelope submit;
  auto* s = submit.mutable_submit_job()->mutable_spec();
  s->set_experts(8);
  s->set_top_k(2);
  s->set_hidden(64);
  s->set_ffn_hidden(32);
  s->set_tokens_per_rank(16);
  s->set_steps(2);
  s->set_skew("zipf:1.5");
  moe::v1::Envelope hello;
  hello.mutable_hello()->set_token("t");
  return {moe::rpc::encode_frame(submit), moe::rpc::encode_frame(hello),
          R"({"experts": 8, "top_k": 2, "hidden": 64, "ffn_hidden": 32, "tokens_per_rank": 16, "steps": 1,
              "score": "sigmoid", "num_groups": 4, "group_top_k": 2, "skew": "zipf:0.5"})",
          "{}", "[1,2]", "\"x\""};
}
