// Clocks shared by every layer: a monotonic clock in seconds for phase timings,
// and wall-clock milliseconds since the Unix epoch for records.
#pragma once

#include <string>

namespace moe {

// Seconds on the steady clock (monotonic; only differences mean anything).
double now_seconds();
// Milliseconds since the Unix epoch on the system clock.
double unix_ms();
// "12:03:04 UTC" for a unix_ms() time; "2026-12-02 12:03:04 UTC" with the date.
std::string utc_time_of_day(double unix_ms);
std::string utc_date_time(double unix_ms);

}  // namespace moe
