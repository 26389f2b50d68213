// The one piece of HTTP the scrape endpoint parses: the request line of a
// request head ("GET /metrics HTTP/1.1"), whatever bytes a client sent.
#pragma once

#include <string>
#include <string_view>

namespace moe::http {

struct Answer {
  int status;          // 200, 400, 404 or 405
  std::string reason;  // "OK", "Bad Request", "Not Found", "Method Not Allowed"
  std::string path;    // a 200's: "/metrics" or "/healthz"
};

// What the endpoint answers a request head: 200 for GET (or HEAD) of /metrics
// or /healthz (with or without a query), 405 for another method on them, 404
// for another path, 400 for a request line that is not METHOD SP TARGET SP HTTP/1.x.
Answer answer_for(std::string_view head);

}  // namespace moe::http
