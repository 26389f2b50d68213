// `moectl completion bash`: a bash completion script generated from the CLI's
// own command tree (every subcommand and option as main() defines them), so it
// never drifts from the commands.
#pragma once

#include <string>

namespace CLI {
class App;
}

namespace moe::ctl {

std::string bash_completion(const CLI::App& app, const std::string& program);

}  // namespace moe::ctl
