// How moectl's commands reach the agent: a client from the resolved address and
// token, and one mapping from errors to exit codes (docs/cli.md#exit-codes).
#pragma once

#include <ostream>

#include "moe/ctl/ctl.h"
#include "moe/rpc/client.h"

namespace moe::ctl {

// UNAVAILABLE and DEADLINE_EXCEEDED: 3; INTERNAL: 1; anything else: 2.
int exit_code_of(const rpc::RpcError& e);
// Throws moe::InvalidArgument naming the fix when it would send the token in
// clear unasked (Resolved::plaintext_ok).
rpc::RpcClient client(const Resolved& r);
// A small text file of the state directory without trailing whitespace ("" if absent).
std::string read_trimmed(const std::string& path);

// Runs fn(agent client, resolved) and maps errors to exit codes with a message on err.
// What an unreachable agent means when moectl found its address in the state
// directory, or found none there: "no cluster is up in DIR ..." ("" otherwise).
std::string unreachable_reason(const Globals& g);

template <typename Fn>
int with_agent(const Globals& g, std::ostream& err, Fn&& fn) {
  try {
    const Resolved r = resolve(g);
    auto c = client(r);
    return fn(c, r);
  } catch (const rpc::RpcError& e) {
    const std::string local = e.code() == v1::ERROR_CODE_UNAVAILABLE ? unreachable_reason(g) : "";
    err << "moectl: " << (local.empty() ? e.what() : local) << "\n";
    return exit_code_of(e);
  } catch (const std::exception& e) {
    err << "moectl: " << e.what() << "\n";
    return kExitUsage;
  }
}

}  // namespace moe::ctl
