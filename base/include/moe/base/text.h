// Words for messages: the nearest of a set of known words to a mistyped one,
// for "did you mean" in moectl's flags and verbs and in spec files.
#pragma once

#include <string>
#include <vector>

namespace moe {

// Levenshtein distance: insertions, deletions and substitutions, one each.
size_t edit_distance(const std::string& a, const std::string& b);

// The known word nearest to `word` within max(2, word.size() / 3) edits, or
// "" when none is that close. One starting with `word` (a prefix the user
// stopped typing) counts as near too. Ties go to the first in `known`.
std::string nearest_word(const std::string& word, const std::vector<std::string>& known);

// `text` with every `from` replaced by `to` (from non-empty), left to right.
std::string replace_all(std::string text, const std::string& from, const std::string& to);

}  // namespace moe
