// moectl's table output.
#pragma once

#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "moe/v1/job.pb.h"

namespace moe::ctl {

std::string state_name(v1::JobState s);  // "SUCCEEDED"
std::string fmt(double v, int precision = 4);
// "key  value" lines with the values aligned.
void print_rows(std::ostream& out, const std::vector<std::pair<std::string, std::string>>& rows);
// Columns padded to their widest cell; the first row is the header.
void print_table(std::ostream& out, const std::vector<std::vector<std::string>>& rows);

}  // namespace moe::ctl
