// --config FILE (TOML or JSON, the flag names as keys) for train, plan and sweep, and the
// resolved-flags TOML that `train --print-config` writes: the file becomes command-line
// arguments placed before the real ones, so every value meets the flag's own validator and a
// flag given on the command line wins (apps/cli_checks.h harden: the last value counts).
#pragma once

#include <CLI/CLI.hpp>
#include <set>
#include <string>
#include <vector>

namespace zt {

// Adds --config FILE to `sub` (its value is read by config_arguments before the parse).
void add_config_option(CLI::App& sub);

// The path of the last --config in `args` (a subcommand's arguments), or "" when there is none.
std::string config_path(const std::vector<std::string>& args);

// Reads `path` (.toml or .json; a regular file through core/files.h) and returns the arguments
// it stands for, as "--name=value" (a flag: "--name" or "--name=false"; a list: one per item),
// checked against the options of `sub`: an unknown key (with the nearest flag name), a value of
// the wrong type (a string for a count, a number for a flag, a list for a single value) or an
// empty value throws zt::Error(kInvalidArgument) with one sentence naming the file and the key.
// Tables are sections for grouping only (torchtitan's [training] steps = 10); '_' in a key reads
// as '-'. A list option given in `cli_args` replaces the file's list instead of adding to it.
std::vector<std::string> config_arguments(const CLI::App& sub, const std::string& path,
                                          const std::vector<std::string>& cli_args);

// The values of every option of `sub` after a parse, as TOML that --config reads back: the given
// value, else the default. Left out, and named in a comment: options without a value (automatic
// defaults, resolved by the run: `auto_values` lists "name = value" comment lines for them), the
// flags in `skip` (ones that do not apply to this run), and help/config/print-config.
std::string format_config(const CLI::App& sub, const std::set<std::string>& skip,
                          const std::vector<std::string>& auto_values);

}  // namespace zt
