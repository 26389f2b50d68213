#include "moe/base/random.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>

#include "moe/base/check.h"

namespace moe {

std::string random_bytes(size_t n) {
  std::string out(n, '\0');
  for (size_t got = 0; got < n;) {
    const ssize_t r = ::getrandom(out.data() + got, n - got, 0);  // blocks only before the pool is seeded
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) throw Error(std::string("getrandom failed: ") + std::strerror(errno));
    got += static_cast<size_t>(r);
  }
  return out;
}

}  // namespace moe
