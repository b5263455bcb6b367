#pragma once
/// \file
/// paratrain::observe::JsonlLog and CsvLog — one line per log point or epoch with the
/// reduced metrics, for pandas, jq, a spreadsheet or scripts/plot.py.

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "paratrain/core/error.hpp"

namespace paratrain::observe {

/// What is logged at one point of training.
struct Record {
  std::string kind;        ///< "step" (a log point, every FitOptions::log_every steps) or "epoch"
  int epoch = 0;           ///< from 0
  std::int64_t step = 0;   ///< optimizer steps done
  double time = 0;         ///< seconds since fit began
  std::map<std::string, double> values;  ///< e.g. "train/loss", "epoch/eval_accuracy"
};

namespace detail {

inline std::FILE* open_log(const std::filesystem::path& path, const char* mode, const char* who) {
  std::error_code ec;
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path(), ec);
  std::FILE* f = std::fopen(path.c_str(), mode);
  if (f == nullptr) throw error(who, -1, "cannot create '" + path.string() + "': " + std::strerror(errno));
  return f;
}

inline std::string number(double v, bool json) {
  if (!std::isfinite(v)) return json ? "null" : (std::isnan(v) ? "nan" : v > 0 ? "inf" : "-inf");
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

inline std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') out += '\\', out += c;
    else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
      out += buf;
    } else out += c;
  }
  return out + "\"";
}

inline std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n\r") == std::string::npos) return s;
  std::string out = "\"";
  for (const char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

}  // namespace detail

/// JSON Lines: one object per record, flushed at once:
/// `{"kind":"step","epoch":0,"step":100,"time":1.25,"train/loss":0.53,...}`.
/// A value that is not finite is written as null.
class JsonlLog {
 public:
  explicit JsonlLog(const std::filesystem::path& path) : file_(detail::open_log(path, "w", "JsonlLog")) {}
  JsonlLog(const JsonlLog&) = delete;
  JsonlLog& operator=(const JsonlLog&) = delete;
  ~JsonlLog() { std::fclose(file_); }

  void write(const Record& r) {
    // Appended piece by piece: GCC 12 warns falsely (-Wstringop-overflow) on `"literal" + std::string&&`.
    std::string line = "{\"kind\":";
    line += detail::json_string(r.kind);
    line += ",\"epoch\":";
    line += std::to_string(r.epoch);
    line += ",\"step\":";
    line += std::to_string(r.step);
    line += ",\"time\":";
    line += detail::number(r.time, true);
    for (const auto& [name, value] : r.values) {
      line += ',';
      line += detail::json_string(name);
      line += ':';
      line += detail::number(value, true);
    }
    line += "}\n";
    std::fputs(line.c_str(), file_);
    std::fflush(file_);
  }

 private:
  std::FILE* file_;
};

/// CSV with a header row: kind, epoch, step, time, then one column per value name
/// (sorted), empty where a record has no such value. A name first seen after some rows
/// were written widens the table: the file is rewritten with the new header (the rows
/// are kept in memory; a run has thousands of log points at most).
class CsvLog {
 public:
  explicit CsvLog(std::filesystem::path path) : path_(std::move(path)), file_(detail::open_log(path_, "w", "CsvLog")) {}
  CsvLog(const CsvLog&) = delete;
  CsvLog& operator=(const CsvLog&) = delete;
  ~CsvLog() { std::fclose(file_); }

  void write(const Record& r) {
    bool widened = rows_.empty();
    for (const auto& [name, value] : r.values)
      if (std::find(columns_.begin(), columns_.end(), name) == columns_.end()) {
        columns_.push_back(name);
        widened = true;
      }
    rows_.push_back(r);
    if (widened) {
      std::sort(columns_.begin(), columns_.end());
      std::fclose(file_);
      file_ = detail::open_log(path_, "w", "CsvLog");
      std::string header = "kind,epoch,step,time";
      for (const auto& c : columns_) {
        header += ',';
        header += detail::csv_field(c);
      }
      std::fputs((header + "\n").c_str(), file_);
      for (const auto& row : rows_) put(row);
    } else {
      put(r);
    }
    std::fflush(file_);
  }

 private:
  void put(const Record& r) {
    std::string line = detail::csv_field(r.kind) + "," + std::to_string(r.epoch) + "," + std::to_string(r.step) + "," +
                       detail::number(r.time, false);
    for (const auto& c : columns_) {
      line += ",";
      if (auto it = r.values.find(c); it != r.values.end()) line += detail::number(it->second, false);
    }
    std::fputs((line + "\n").c_str(), file_);
  }

  std::filesystem::path path_;
  std::FILE* file_;
  std::vector<std::string> columns_;
  std::vector<Record> rows_;
};

}  // namespace paratrain::observe
