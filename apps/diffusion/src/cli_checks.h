#pragma once
// Command-line checks of flame-diffusion (main.cpp): strict number parsing with range checks whose
// messages name the flag, the value and the allowed range in words ("--steps must be a positive
// integer (got 0)"), and "did you mean" suggestions for mistyped subcommands and flags.
//
// CLI11 converts integers with strtoll, which clamps 99999999999999999999 to 2^63 - 1 without a
// word, and accepts 0x10 and 010; its range validator prints the limits of a double. So every
// numeric flag gets one of these checks, which run on the text before CLI11 converts it, and a
// failed check raises UsageError (main prints it and exits with status 2).
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace flame_diffusion {

// A mistake on the command line: main prints the message and exits with status 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A decimal integer (optional sign, digits only) that fits int64; nullopt otherwise.
std::optional<int64_t> parse_int64(const std::string& text);
// A finite real number (strtod syntax, the whole text); nullopt otherwise (inf, nan, 1e999 too).
std::optional<double> parse_finite(const std::string& text);

// "" when `text` is an integer in [lo, hi], else "<flag> must be <words> (got <text>)" (with the
// reason when the text is no integer or overflows int64).
std::string check_int(const std::string& flag, const std::string& text, int64_t lo, int64_t hi,
                      const std::string& words);
// Reals: in [lo, hi], with either end open (lo_open: > lo; hi_open: < hi).
std::string check_real(const std::string& flag, const std::string& text, double lo, double hi, bool lo_open,
                       bool hi_open, const std::string& words);

// CLI11 validators raising UsageError with check_int / check_real's message. `words` is the range
// in words, e.g. "a positive integer", "an integer from 1 to 8", "a non-negative number (0: off)".
CLI::Validator int_in(const std::string& flag, int64_t lo, int64_t hi, const std::string& words);
CLI::Validator real_in(const std::string& flag, double lo, double hi, bool lo_open, bool hi_open,
                       const std::string& words);

// Edit distance: insertions, deletions, substitutions and swaps of two adjacent characters, each
// costing 1 (the optimal-string-alignment form of the Damerau-Levenshtein distance).
std::size_t edit_distance(const std::string& a, const std::string& b);
// The candidate nearest to `word` when it is close enough to be a typo: distance at most
// max(1, word length / 3) (and less than the word's length); ties go to the first candidate.
std::optional<std::string> nearest(const std::string& word, const std::vector<std::string>& candidates);

// The message for argv before CLI11 parses it, or nullopt: an unknown subcommand
// ("unknown subcommand 'trian'; did you mean 'train'? (commands: train, ...)").
std::optional<std::string> check_subcommand(const CLI::App& app, int argc, const char* const* argv);
// After CLI11 refused extra arguments: names the first unknown --flag of the chosen subcommand
// with the nearest known one ("unknown flag --stpes for train; did you mean --steps?"); nullopt
// when every --flag is known.
std::optional<std::string> unknown_flag_message(const CLI::App& app, int argc, const char* const* argv);

}  // namespace flame_diffusion
