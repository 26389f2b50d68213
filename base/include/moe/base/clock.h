// Clocks shared by every layer: a monotonic clock in seconds for phase timings,
// and wall-clock milliseconds since the Unix epoch for records.
#pragma once

namespace moe {

// Seconds on the steady clock (monotonic; only differences mean anything).
double now_seconds();
// Milliseconds since the Unix epoch on the system clock.
double unix_ms();

}  // namespace moe
