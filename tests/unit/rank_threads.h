// Ranks as threads of one test process, one Communicator each, for the transport
// and EP tests.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "moe/transport/communicator.h"

namespace moe::test {

// kHybrid: two "daemons" in this process (ranks split in halves), each half a
// LocalHub: in-process inside a half, UCX between halves.
enum class Kind { kInProc, kUcx, kHybrid };

// Runs body(comm) on R threads, one communicator each; returns each rank's error
// message ("" if it returned normally). A rank that throws aborts its in-process
// group or hub so its peers fail instead of waiting. hub_pending (kHybrid): the
// messages the hubs still hold afterwards.
std::vector<std::string> run_ranks(Kind kind, int R, const std::function<void(transport::Communicator&)>& body,
                                   size_t* hub_pending = nullptr);

}  // namespace moe::test
