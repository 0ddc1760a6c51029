// "Did you mean ...?" for mistyped flags and subcommands: the nearest candidate by edit distance.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace zt {

// Levenshtein distance (insertions, deletions, substitutions each cost 1).
size_t edit_distance(const std::string& a, const std::string& b);

// The candidate nearest to `given`, if it is close enough to be a plausible typo: at most
// max(2, |given| / 3) edits (so "--stpes" -> "--steps", but "--frobnicate" -> nothing). Ties go
// to the earlier candidate.
std::optional<std::string> nearest_name(const std::string& given, const std::vector<std::string>& candidates);

}  // namespace zt
