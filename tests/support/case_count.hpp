#pragma once
// A doctest listener that counts the cases a run entered and those that skipped themselves
// at run time (tests/gpu/gpu_support.hpp's skipped(): doctest has no run-time skip, so such a
// case returns having checked nothing, and doctest counts it as passed). The GPU suite's
// driver (gloo_main.cpp) prints both counts, and fails a run in which every case skipped:
// nothing was checked, which must not read as passed.
#include "support/doctest.hpp"

namespace paratrain_test {

struct CaseCount {
  int entered = 0;
  int skipped = 0;
  bool current_skipped = false;
};
inline CaseCount& case_count() {
  static CaseCount count;
  return count;
}

struct CountCases : doctest::IReporter {
  explicit CountCases(const doctest::ContextOptions&) {}
  void test_case_start(const doctest::TestCaseData&) override {
    ++case_count().entered;
    case_count().current_skipped = false;
  }
  void test_case_end(const doctest::CurrentTestCaseStats&) override {
    if (case_count().current_skipped) ++case_count().skipped;
  }
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};

}  // namespace paratrain_test
