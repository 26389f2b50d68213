#include "usage_errors.h"

#include <CLI/CLI.hpp>

#include <optional>

#include "moe/base/text.h"
#include "moe/ctl/ctl.h"

namespace moe::ctl {
namespace {

// "moectl job submit": the command path of `app`.
std::string path_of(const CLI::App& app) {
  return app.get_parent() ? path_of(*app.get_parent()) + " " + app.get_name() : "moectl";
}

std::vector<const CLI::App*> verbs_of(const CLI::App& app) {
  std::vector<const CLI::App*> out;
  for (const CLI::App* sub : app.get_subcommands({}))
    if (!sub->get_group().empty()) out.push_back(sub);
  return out;
}

const CLI::App* verb_named(const CLI::App& app, const std::string& name) {
  for (const CLI::App* sub : verbs_of(app))
    if (sub->get_name() == name) return sub;
  return nullptr;
}

// The option `--name` or `-n` of `app` or a command above it (moectl's global
// options fall through to every command).
const CLI::Option* option_named(const CLI::App& app, const std::string& name) {
  for (const CLI::App* a = &app; a; a = a->get_parent())
    if (const CLI::Option* o = a->get_option_no_throw(name)) return o;
  return nullptr;
}

// Every flag spelling `app` and the commands above it accept.
std::vector<std::string> flag_words(const CLI::App& app) {
  std::vector<std::string> out;
  for (const CLI::App* a = &app; a; a = a->get_parent())
    for (const CLI::Option* o : a->get_options()) {
      for (const std::string& l : o->get_lnames()) out.push_back("--" + l);
      for (const std::string& s : o->get_snames()) out.push_back("-" + s);
    }
  return out;
}

std::string did_you_mean(const std::string& word, const std::vector<std::string>& known, const std::string& quote) {
  const std::string best = nearest_word(word, known);
  return best.empty() ? "" : " (did you mean " + quote + best + quote + "?)";
}

// The first mistake the walk down the command tree finds in `args`: a verb or
// flag that does not exist, or a command left without its verb. nullopt when the
// words are all known (the error is about a value).
std::optional<std::string> diagnose(const CLI::App& root, const std::vector<std::string>& args) {
  const CLI::App* at = &root;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& word = args[i];
    if (word == "--") break;
    if (word.size() > 1 && word[0] == '-' && !(std::isdigit(static_cast<unsigned char>(word[1])) || word[1] == '.')) {
      const std::string name = word.substr(0, word.find('='));
      const CLI::Option* o = option_named(*at, name);
      if (!o)
        return path_of(*at) + ": unknown flag " + name + did_you_mean(name, flag_words(*at), "") + "; '" +
               path_of(*at) + " --help' lists the flags";
      if (o->get_type_size() != 0 && word.find('=') == std::string::npos) ++i;  // its value
      continue;
    }
    if (verbs_of(*at).empty()) continue;  // a positional argument
    if (const CLI::App* sub = verb_named(*at, word)) {
      at = sub;
      continue;
    }
    if (at->get_require_subcommand_min() == 0) continue;
    std::vector<std::string> names;
    for (const CLI::App* v : verbs_of(*at)) names.push_back(v->get_name());
    return path_of(*at) + ": unknown command '" + word + "'" + did_you_mean(word, names, "'") + "; '" + path_of(*at) +
           " --help' lists the commands";
  }
  if (at->get_require_subcommand_min() > 0) {
    std::string names;
    for (const CLI::App* v : verbs_of(*at)) names += (names.empty() ? "" : ", ") + v->get_name();
    return path_of(*at) + ": a command is required: " + names;
  }
  return std::nullopt;
}

}  // namespace

int report_parse_error(CLI::App& app, const CLI::ParseError& e, const std::vector<std::string>& args,
                       std::ostream& err) {
  if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
  if (dynamic_cast<const CLI::ExtrasError*>(&e) || dynamic_cast<const CLI::RequiredError*>(&e)) {
    if (const auto why = diagnose(app, args)) {
      err << *why << "\n";
      return kExitUsage;
    }
  }
  err << "moectl: " << e.what() << "\n";
  return kExitUsage;
}

}  // namespace moe::ctl
