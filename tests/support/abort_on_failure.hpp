#pragma once
// A doctest listener for the multi-process test drivers (main.cpp under mpirun, gloo_main.cpp
// under tests/launch/torchrun_style.sh): a failed check on one rank of several prints where
// and ends the whole job at once. The other ranks might otherwise wait in a collective that
// the failing rank, now on another path, never joins, until ctest's timeout.
//
// Each driver defines the three functions below and registers the listener
// (REGISTER_LISTENER) in its own TU.
#include <cstdio>
#include <string>

#include "support/doctest.hpp"

namespace paratrain_test {

int job_rank();
int job_size();
[[noreturn]] void end_job();  // MPI_Abort, or _Exit (the launcher then stops the others)

// Listeners run before the console reporter, so this one prints the failure itself.
struct AbortOnFailure : doctest::IReporter {
  explicit AbortOnFailure(const doctest::ContextOptions&) {}
  void log_assert(const doctest::AssertData& a) override {
    if (!a.m_failed || job_size() == 1) return;
    std::fprintf(stderr, "rank %d: %s:%d: %s( %s ) failed, with %s%s%s%s\nrank %d: ending the whole job\n", job_rank(),
                 a.m_file, a.m_line, doctest::assertString(a.m_at), a.m_expr, a.m_decomp.c_str(),
                 a.m_threw ? " (threw: " : "", a.m_threw ? a.m_exception.c_str() : "", a.m_threw ? ")" : "", job_rank());
    std::fflush(nullptr);
    end_job();
  }
  void test_case_exception(const doctest::TestCaseException& e) override {
    if (job_size() == 1) return;
    std::fprintf(stderr, "rank %d: test case threw: %s\nrank %d: ending the whole job\n", job_rank(),
                 e.error_string.c_str(), job_rank());
    std::fflush(nullptr);
    end_job();
  }
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_start(const doctest::TestCaseData&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};

}  // namespace paratrain_test
