// Secrets from the kernel's CSPRNG (getrandom(2)): cluster tokens and the
// per-job keys of the data plane and the tensor wire.
#pragma once

#include <string>

namespace moe {

// n bytes from getrandom; throws moe::Error when the kernel cannot give them.
std::string random_bytes(size_t n);

}  // namespace moe
