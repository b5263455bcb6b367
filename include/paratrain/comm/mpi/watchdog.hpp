#pragma once
/// \file
/// The watchdog's channel under MPI: Note [Watchdog] (reliability/watchdog.hpp).

#include <mpi.h>

#include <chrono>
#include <list>
#include <map>
#include <thread>
#include <vector>

#include "paratrain/reliability/watchdog.hpp"

namespace paratrain::detail {

/// The world ranks of `comm`'s members, in its rank order.
inline std::vector<int> world_ranks(MPI_Comm comm) {
  MPI_Group group = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
  MPI_Comm_group(comm, &group);
  MPI_Comm_group(MPI_COMM_WORLD, &world);
  int size = 0;
  MPI_Group_size(group, &size);
  std::vector<int> mine(static_cast<std::size_t>(size)), out(static_cast<std::size_t>(size));
  for (int i = 0; i < size; ++i) mine[static_cast<std::size_t>(i)] = i;
  MPI_Group_translate_ranks(group, size, mine.data(), world, out.data());
  MPI_Group_free(&group);
  MPI_Group_free(&world);
  return out;
}

/// Questions and answers between the ranks' watchdog threads on a duplicate of
/// MPI_COMM_WORLD that nothing else uses: a stuck communicator cannot block them, and
/// each thread makes its own progress (Open MPI has no progress thread). Needs
/// MPI_THREAD_MULTIPLE (Mpi::Environment asks for it); without it the watchdog reports
/// what this rank knows and ends the job without asking.
class MpiWatchdogChannel final : public WatchdogChannel {
 public:
  MpiWatchdogChannel() {
    MPI_Comm_dup(MPI_COMM_WORLD, &comm_);
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    int level = MPI_THREAD_SINGLE;
    MPI_Query_thread(&level);
    threaded_ = level == MPI_THREAD_MULTIPLE;
  }
  // Never freed: the watchdog lives as long as the process, and MPI_Comm_free after
  // MPI_Finalize would be an error.

  [[nodiscard]] int world_rank() const override { return rank_; }
  [[nodiscard]] int world_size() const override { return size_; }

  void serve(const std::function<RankStatus(std::int64_t)>& describe_self) override {
    if (!threaded_ || finalised()) return;
    for (;;) {
      int flag = 0;
      MPI_Status st{};
      if (MPI_Iprobe(MPI_ANY_SOURCE, ask_tag, comm_, &flag, &st) != MPI_SUCCESS || !flag) break;
      std::int64_t ledger = 0;
      MPI_Recv(&ledger, 1, MPI_INT64_T, st.MPI_SOURCE, ask_tag, comm_, MPI_STATUS_IGNORE);
      auto& [answer, request] = answers_.emplace_back(describe_self(ledger), MPI_REQUEST_NULL);
      answer.world_rank = rank_;
      MPI_Isend(&answer, sizeof answer, MPI_BYTE, st.MPI_SOURCE, answer_tag, comm_, &request);
    }
    answers_.remove_if([](auto& a) {  // forget the answers whose sends completed
      int done = 0;
      MPI_Test(&a.second, &done, MPI_STATUS_IGNORE);
      return done != 0;
    });
  }

  std::map<int, RankStatus> ask(std::int64_t ledger, std::chrono::milliseconds grace,
                                const std::function<RankStatus(std::int64_t)>& describe_self) override {
    std::map<int, RankStatus> answers;
    if (!threaded_ || finalised()) return answers;
    question_ = ledger;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      // A stopped rank never takes the question: its request is never waited for.
      MPI_Isend(&question_, 1, MPI_INT64_T, r, ask_tag, comm_, &questions_.emplace_back(MPI_REQUEST_NULL));
    }
    const auto until = std::chrono::steady_clock::now() + grace;
    while (static_cast<int>(answers.size()) < size_ - 1 && std::chrono::steady_clock::now() < until) {
      serve(describe_self);  // ranks asking at the same time answer each other
      int flag = 0;
      MPI_Status st{};
      if (MPI_Iprobe(MPI_ANY_SOURCE, answer_tag, comm_, &flag, &st) == MPI_SUCCESS && flag) {
        RankStatus s;
        MPI_Recv(&s, sizeof s, MPI_BYTE, st.MPI_SOURCE, answer_tag, comm_, MPI_STATUS_IGNORE);
        answers[st.MPI_SOURCE] = s;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
    return answers;
  }

  [[noreturn]] void end_job(int code) override {
    if (!finalised()) MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);
  }

 private:
  static constexpr int ask_tag = 1, answer_tag = 2;

  static bool finalised() {
    int done = 0;
    MPI_Finalized(&done);
    return done != 0;
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  bool threaded_ = false;
  std::int64_t question_ = 0;
  std::list<std::pair<RankStatus, MPI_Request>> answers_;  // being sent: their addresses must not move
  std::vector<MPI_Request> questions_;
};

}  // namespace paratrain::detail
