// What moectl says when CLI11 refuses a command line (docs/cli.md#exit-codes):
// a mistyped verb or flag names the nearest one moectl's own command tree has
// ("moectl job: unknown command 'stats' (did you mean 'status'?)"), a missing
// verb lists the verbs, everything else is CLI11's message in moectl's form.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace CLI {
class App;
class ParseError;
}  // namespace CLI

namespace moe::ctl {

// Prints the message for `e` (help and --version as CLI11 prints them) and
// returns the exit code: 0 for help and version, kExitUsage otherwise.
// `args` is the command line without the program name.
int report_parse_error(CLI::App& app, const CLI::ParseError& e, const std::vector<std::string>& args,
                       std::ostream& err);

}  // namespace moe::ctl
