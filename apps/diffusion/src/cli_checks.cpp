#include "cli_checks.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

namespace flame_diffusion {

std::optional<int64_t> parse_int64(const std::string& text) {
  std::size_t i = 0;
  bool negative = false;
  if (i < text.size() && (text[i] == '+' || text[i] == '-')) negative = text[i++] == '-';
  if (i == text.size()) return std::nullopt;
  // Accumulated as a negative number, whose range is one larger than the positive one.
  int64_t v = 0;
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  for (; i < text.size(); ++i) {
    const char c = text[i];
    if (c < '0' || c > '9') return std::nullopt;
    const int d = c - '0';
    if (v < (kMin + d) / 10) return std::nullopt;  // v * 10 - d < kMin
    v = v * 10 - d;
  }
  if (negative) return v;
  if (v == kMin) return std::nullopt;
  return -v;
}

std::optional<double> parse_finite(const std::string& text) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0]))) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + text.size() || !std::isfinite(v) || errno == ERANGE) return std::nullopt;
  return v;
}

namespace {

bool all_digits(const std::string& s, std::size_t from) {
  if (from >= s.size()) return false;
  return std::all_of(s.begin() + static_cast<std::ptrdiff_t>(from), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

}  // namespace

std::string check_int(const std::string& flag, const std::string& text, int64_t lo, int64_t hi,
                      const std::string& words) {
  const std::string head = flag + " must be " + words + " (got " + text;
  const std::optional<int64_t> v = parse_int64(text);
  if (!v) {
    const std::size_t from = !text.empty() && (text[0] == '+' || text[0] == '-') ? 1 : 0;
    if (all_digits(text, from)) {
      return head + ", which is outside the 64-bit integer range " + std::to_string(std::numeric_limits<int64_t>::min()) +
             " .. " + std::to_string(std::numeric_limits<int64_t>::max()) + ")";
    }
    return head + ", which is not a whole number in decimal digits)";
  }
  if (*v < lo || *v > hi) return head + ")";
  return "";
}

std::string check_real(const std::string& flag, const std::string& text, double lo, double hi, bool lo_open,
                       bool hi_open, const std::string& words) {
  const std::string head = flag + " must be " + words + " (got " + text;
  const std::optional<double> v = parse_finite(text);
  if (!v) return head + ", which is not a finite number)";
  const bool below = lo_open ? !(*v > lo) : !(*v >= lo);
  const bool above = hi_open ? !(*v < hi) : !(*v <= hi);
  if (below || above) return head + ")";
  return "";
}

namespace {

// "(0, 10]", "[0, 1)", ">= 0" (an upper end of 1e6 or more is shown as none) for --help.
std::string real_range_text(double lo, double hi, bool lo_open, bool hi_open) {
  char buf[64];
  if (hi >= 1e6) std::snprintf(buf, sizeof buf, "%s %g", lo_open ? ">" : ">=", lo);
  else std::snprintf(buf, sizeof buf, "%c%g, %g%c", lo_open ? '(' : '[', lo, hi, hi_open ? ')' : ']');
  return buf;
}

}  // namespace

CLI::Validator int_in(const std::string& flag, int64_t lo, int64_t hi, const std::string& words) {
  // Shown by --help after the type, e.g. "INT:POSITIVE", "INT:1..8".
  std::string desc;
  if (hi != std::numeric_limits<int64_t>::max()) desc = std::to_string(lo) + ".." + std::to_string(hi);
  else if (lo == 1) desc = "POSITIVE";
  else if (lo == 0) desc = "NON-NEGATIVE";
  else desc = ">= " + std::to_string(lo);
  return CLI::Validator(
      [flag, lo, hi, words](std::string& text) {
        const std::string m = check_int(flag, text, lo, hi, words);
        if (!m.empty()) throw UsageError(m);
        return std::string();
      },
      desc);
}

CLI::Validator real_in(const std::string& flag, double lo, double hi, bool lo_open, bool hi_open,
                       const std::string& words) {
  return CLI::Validator(
      [flag, lo, hi, lo_open, hi_open, words](std::string& text) {
        const std::string m = check_real(flag, text, lo, hi, lo_open, hi_open, words);
        if (!m.empty()) throw UsageError(m);
        return std::string();
      },
      real_range_text(lo, hi, lo_open, hi_open));
}

std::size_t edit_distance(const std::string& a, const std::string& b) {
  // Optimal string alignment: Levenshtein's table plus a swap of two adjacent characters as one
  // edit (the commonest typo, "trian" for "train").
  const std::size_t n = a.size(), m = b.size();
  std::vector<std::vector<std::size_t>> d(n + 1, std::vector<std::size_t>(m + 1));
  for (std::size_t i = 0; i <= n; ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= m; ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= n; ++i) {
    for (std::size_t j = 1; j <= m; ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[n][m];
}

std::optional<std::string> nearest(const std::string& word, const std::vector<std::string>& candidates) {
  const std::size_t limit = std::max<std::size_t>(1, word.size() / 3);
  std::optional<std::string> best;
  std::size_t best_d = 0;
  for (const std::string& c : candidates) {
    const std::size_t d = edit_distance(word, c);
    if (d <= limit && d < word.size() && (!best || d < best_d)) {
      best = c;
      best_d = d;
    }
  }
  return best;
}

namespace {

std::vector<std::string> subcommand_names(const CLI::App& app) {
  std::vector<std::string> names;
  for (const CLI::App* s : app.get_subcommands([](const CLI::App*) { return true; })) names.push_back(s->get_name());
  return names;
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

}  // namespace

std::optional<std::string> check_subcommand(const CLI::App& app, int argc, const char* const* argv) {
  if (argc < 2) return std::nullopt;
  const std::string word = argv[1];
  if (word.empty() || word[0] == '-') return std::nullopt;
  const std::vector<std::string> names = subcommand_names(app);
  if (std::find(names.begin(), names.end(), word) != names.end()) return std::nullopt;
  std::string m = "unknown subcommand '" + word + "'";
  if (const auto n = nearest(word, names)) m += "; did you mean '" + *n + "'?";
  return m + " (commands: " + joined(names) + ")";
}

std::optional<std::string> unknown_flag_message(const CLI::App& app, int argc, const char* const* argv) {
  const CLI::App* cmd = &app;
  int first = 1;
  if (argc >= 2) {
    for (const CLI::App* s : app.get_subcommands([](const CLI::App*) { return true; })) {
      if (s->get_name() == argv[1]) {
        cmd = s;
        first = 2;
      }
    }
  }
  std::vector<std::string> known;
  for (const CLI::Option* o : cmd->get_options()) {
    for (const std::string& n : o->get_lnames()) known.push_back("--" + n);
  }
  for (int i = first; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0 || a.size() == 2) continue;
    a = a.substr(0, a.find('='));
    if (std::find(known.begin(), known.end(), a) != known.end()) continue;
    std::string m = "unknown flag " + a + (cmd == &app ? std::string() : " for " + cmd->get_name());
    if (const auto n = nearest(a, known)) m += "; did you mean " + *n + "?";
    return m + " (`flame-diffusion " + (cmd == &app ? std::string() : cmd->get_name() + " ") + "--help` lists them)";
  }
  return std::nullopt;
}

}  // namespace flame_diffusion
