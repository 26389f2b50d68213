// Fuzz target: the request head a client sends the /metrics endpoint. Every head
// gets one of the four answers, and a 200 only for GET or HEAD of /metrics or /healthz.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "moe/http/request_head.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view head(reinterpret_cast<const char*>(data), size);
  const moe::http::Answer a = moe::http::answer_for(head);
  if (a.status != 200 && a.status != 400 && a.status != 404 && a.status != 405) std::abort();
  const bool served = head.rfind("GET /metrics", 0) == 0 || head.rfind("HEAD /metrics", 0) == 0 ||
                      head.rfind("GET /healthz", 0) == 0 || head.rfind("HEAD /healthz", 0) == 0;
  if (a.status == 200 && (!served || (a.path != "/metrics" && a.path != "/healthz"))) std::abort();
  return 0;
}

std::vector<std::string> fuzz_seeds() {
  return {"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", "HEAD /metrics?a=b HTTP/1.0\r\n\r\n",
          "POST /metrics HTTP/1.1\r\n\r\n", "GET / HTTP/1.1\r\n\r\n", "GET /metrics HTTP/2\r\n\r\n", "\r\n\r\n"};
}
