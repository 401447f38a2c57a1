// The kernels' own threads (`Team`) and how work is shared among them (`share`).
#pragma once

#include "common.h"

namespace {

// The threads the kernels share their work with: the caller and torch's thread count less
// one helpers (fixed at first use), each helper awake (spinning) for SPIN after its last
// job before it sleeps. So the ~120 calls of a decode step wake a helper once, not once a
// call: torch's OpenMP threads, under OMP_WAIT_POLICY=PASSIVE, sleep after every parallel
// region, and waking one cost ~25 us a call here (a one-row GEMV's whole time).
class Team {
 public:
  static constexpr auto SPIN = std::chrono::microseconds(500);
  static constexpr int WAIT_SPINS = 1000;  // ~15 us of pauses for the helpers, then yields

  // This process's team, built anew in a forked child (the parent's helpers are not in
  // it) and when torch's thread count has grown past it (the old helpers sleep on).
  static Team& get() {
    static Team* team = nullptr;
    static std::mutex made;
    std::lock_guard<std::mutex> lock(made);
    if (team == nullptr || team->pid_ != getpid() || team->size_ < at::get_num_threads())
      team = new Team(std::max(1, at::get_num_threads()));  // lives as long as the process
    return *team;
  }

  int size() const { return size_; }

  // job(i) for i < threads (<= size()) at once, the caller running job(0); returns when all have.
  void run(int threads, const std::function<void(int)>& job) {
    std::lock_guard<std::mutex> one_at_a_time(running_);
    job_ = &job;
    threads_ = threads;
    pending_.store(size_ - 1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mu_);
      epoch_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    job(0);
    // a helper held off its core (by another process's thread: a shared machine) is waited
    // for on a yield, not spun through the rest of this thread's time slice
    for (int spins = 0; pending_.load(std::memory_order_acquire) != 0; ++spins) {
      if (spins < WAIT_SPINS) _mm_pause();
      else std::this_thread::yield();
    }
  }

 private:
  explicit Team(int size) : size_(size), pid_(getpid()) {
    for (int i = 1; i < size; ++i) std::thread([this, i] { loop(i); }).detach();
  }

  void loop(int index) {
    uint64_t seen = 0;
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      for (int spins = 0; epoch_.load(std::memory_order_acquire) == seen; ++spins) {
        std::this_thread::yield();  // a thread of torch's own (attention, prefill) may want this core
        if (spins % 16 == 0 && std::chrono::steady_clock::now() - start > SPIN) {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [&] { return epoch_.load(std::memory_order_acquire) != seen; });
        }
      }
      seen = epoch_.load(std::memory_order_acquire);
      if (index < threads_) (*job_)(index);
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  const int size_;
  const pid_t pid_;
  const std::function<void(int)>* job_ = nullptr;
  int threads_ = 1;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> pending_{0};
  std::mutex mu_, running_;
  std::condition_variable cv_;
};

// Runs fn(i0, i1, thread) over [0, n) in pieces of `piece`, the team's threads (numbered
// from 0, the caller) taking the next piece as they finish; inline (thread 0) unless
// `parallel`.
template <typename F>
void share(int64_t n, int64_t piece, bool parallel, const F& fn) {
  if (!parallel || n <= piece || at::get_num_threads() == 1 || at::in_parallel_region()) {
    fn(int64_t{0}, n, 0);
    return;
  }
  Team& team = Team::get();
  std::atomic<int64_t> next{0};
  team.run(std::min(team.size(), at::get_num_threads()), [&](int thread) {
    for (int64_t i; (i = next.fetch_add(piece)) < n;) fn(i, std::min(n, i + piece), thread);
  });
}

// Threads `share` may use (scratch space for each).
int64_t team_threads() { return std::min<int64_t>(Team::get().size(), at::get_num_threads()); }

// Rows a piece of a GEMV streaming N rows of K weights: a quarter of each thread's share
// (long runs of rows for the weights' prefetch; a slow thread's rest taken by the others),
// at least PIECE weights, a multiple of 4. Zen 1: ~1.3x the speed of PIECE-weight pieces.
int64_t stream_piece(int64_t N, int64_t K) {
  return std::max({int64_t{4}, PIECE / K / 4 * 4, N / (4 * team_threads()) / 4 * 4});
}

}  // namespace
