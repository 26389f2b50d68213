// moectl's table output.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "moe/v1/job.pb.h"

namespace moe::ctl {

std::string state_name(v1::JobState s);  // "SUCCEEDED"
std::string fmt(double v, int precision = 4);
// "978 MB", "1.46 GB", "512 B": decimal units, three significant digits.
std::string human_bytes(double bytes);
// "980", "46.3k", "1.07M": a count or rate for a column, three significant digits.
std::string human_count(double v);
// A rate or time in full for a detail view: "46269" (whole from 100 up), "12.5" below.
std::string rate_text(double v);
// "1 rank", "4 ranks": n and the noun, plural unless n is 1.
std::string counted(int64_t n, const std::string& noun);
// "45s", "3m05s", "2h03m": a duration for people.
std::string human_seconds(double seconds);
// A unix_ms time in local time: "14:03:04" today, else "12-01 14:03".
std::string local_time(double unix_ms);
// Columns of the terminal on stdout; when stdout is not one, $COLUMNS or `otherwise`.
int terminal_columns(int otherwise);
// "4 ranks", or "4 ranks (2 alive)" when some are not: how cluster status and
// top both count a cluster (a job runs on every registered rank).
std::string ranks_text(int registered, int alive);
// text cut to at most width characters ("..." at the end when cut).
std::string cut(const std::string& text, size_t width);
// text word-wrapped at width, continuation lines indented; each line ends in '\n'.
std::string wrap(const std::string& text, int width, int indent);
// "key  value" lines with the values aligned.
void print_rows(std::ostream& out, const std::vector<std::pair<std::string, std::string>>& rows);
// Columns padded to their widest cell; the first row is the header.
void print_table(std::ostream& out, const std::vector<std::vector<std::string>>& rows);

}  // namespace moe::ctl
