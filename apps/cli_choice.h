// Enumerated and parsed flags, read once where the command line is parsed: an enumerated flag's
// words, the check, the help's list and the default shown come from one table; a parsed flag's
// text becomes its value through the parser that states what is wrong in one sentence.
#pragma once

#include <CLI/CLI.hpp>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"

namespace zt_cli {

// An enumerated flag: each word and the value it stands for, in the order --help lists them.
template <class E>
using Choices = std::vector<std::pair<std::string, E>>;

template <class E>
CLI::Option* add_choice(CLI::App& sub, const std::string& flag, E& target, const Choices<E>& choices,
                        const std::string& help) {
  std::vector<std::string> words;
  std::string current;
  for (const auto& [word, value] : choices) {
    words.push_back(word);
    if (value == target && current.empty()) current = word;
  }
  return sub
      .add_option_function<std::string>(
          flag,
          [&target, choices](const std::string& text) {
            for (const auto& [word, value] : choices)
              if (word == text) target = value;
          },
          help)
      ->default_str(current)
      ->check(CLI::IsMember(words));
}

// The choices of an enumeration that has a name function, in the order given.
template <class E, class NameFn>
Choices<E> named(std::initializer_list<E> values, NameFn name) {
  Choices<E> out;
  for (E v : values) out.emplace_back(name(v), v);
  return out;
}

// A flag whose text becomes a value through `parse` (which throws zt::Error with one sentence):
// the sentence is CLI11's validation error, so a bad value is a usage error (exit code 2).
template <class T, class Parse>
CLI::Option* add_parsed(CLI::App& sub, const std::string& flag, T& target, Parse parse, const std::string& help) {
  return sub.add_option_function<std::string>(
      flag,
      [&target, parse](const std::string& text) {
        try {
          target = parse(text);
        } catch (const zt::Error& e) {
          throw CLI::ValidationError(e.message());
        }
      },
      help);
}

}  // namespace zt_cli
