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

// The team's threads going through one whole computation together (`Gang::run`), each
// running the same code: a `share` within hands each thread its own run of the pieces
// (thread i the i-th of `size()` equal runs; a thread done with its own takes what is left
// of the others') and returns when all are done (`sync`, a spin barrier). One hand-off a
// computation instead of one a `share`: a decode step's ~150 shares cost ~3.7 us each on
// Zen 4 through `Team::run` (the helper woken, pieces handed out one at a time), a barrier
// a fraction of a microsecond. Every thread must make the same `share`s and `sync`s in the
// same order.
class Gang {
 public:
  // body(thread) on `threads` (<= the team's size) at once, numbered from 0 (the caller),
  // each in its own gang place (`current()`); returns when all have, rethrowing the first
  // exception one threw (the others stop at their next sync). Not within another gang.
  template <typename F>
  static void run(int threads, const F& body) {
    TORCH_CHECK(current_ == nullptr, "a gang within a gang");
    Shared shared(threads);
    auto job = [&](int index) {
      Gang gang(shared, index);
      current_ = &gang;
      try {
        body(index);
      } catch (const Broken&) {  // another thread's exception stopped this one
      } catch (...) {
        shared.fail(std::current_exception());
      }
      current_ = nullptr;
    };
    if (threads == 1) job(0);
    else Team::get().run(threads, job);
    if (shared.error) std::rethrow_exception(shared.error);
  }

  // The gang this thread is in (nullptr: none).
  static Gang* current() { return current_; }

  int size() const { return shared_.size; }

  // Returns when every thread of the gang has called it.
  void sync() {
    if (shared_.size == 1) return;
    const int generation = shared_.generation.load(std::memory_order_acquire);
    if (shared_.arrived.fetch_add(1, std::memory_order_acq_rel) == shared_.size - 1) {
      shared_.arrived.store(0, std::memory_order_relaxed);
      shared_.generation.store(generation + 1, std::memory_order_release);
      return;
    }
    // a thread held off its core (another process's, or this one's server) is waited for
    // on a yield after ~15 us of pauses
    for (int spins = 0; shared_.generation.load(std::memory_order_acquire) == generation; ++spins) {
      if (shared_.broken.load(std::memory_order_relaxed)) throw Broken();
      if (spins < SPINS) _mm_pause();
      else std::this_thread::yield();
    }
  }

  // fn(i0, i1, index()) over this thread's run of [0, n)'s pieces of `piece`, a piece at a
  // time from its front, then over pieces taken from the back of the others' runs while
  // they last; then `sync`.
  template <typename F>
  void split(int64_t n, int64_t piece, const F& fn) {
    const int64_t pieces = (n + piece - 1) / piece, T = size();
    auto run_of = [&](int64_t t) { return Run::of(pieces * t / T, pieces * (t + 1) / T); };
    auto call = [&](int64_t p) { fn(p * piece, std::min(n, (p + 1) * piece), index_); };
    std::atomic<uint64_t>& own = shared_.runs[index_].run;
    own.store(run_of(index_), std::memory_order_release);
    for (int64_t p; (p = Run::take(own, true)) >= 0;) call(p);
    for (int64_t k = 1; k < T; ++k) {
      std::atomic<uint64_t>& other = shared_.runs[(index_ + k) % T].run;
      for (int64_t p; (p = Run::take(other, false)) >= 0;) call(p);
    }
    sync();
  }

 private:
  static constexpr int SPINS = 1000;
  struct Broken {};
  // A thread's run of pieces [first, last) as one atomic word (last in the high half), taken
  // a piece at a time from the front (its thread) or the back (the others).
  struct alignas(64) Run {
    std::atomic<uint64_t> run{0};
    static uint64_t of(int64_t first, int64_t last) {
      return static_cast<uint64_t>(last) << 32 | static_cast<uint64_t>(first);
    }
    // The piece taken (-1: none left).
    static int64_t take(std::atomic<uint64_t>& run, bool front) {
      uint64_t seen = run.load(std::memory_order_acquire);
      for (;;) {
        const int64_t first = seen & 0xFFFFFFFF, last = seen >> 32;
        if (first >= last) return -1;
        const uint64_t left = front ? of(first + 1, last) : of(first, last - 1);
        if (run.compare_exchange_weak(seen, left, std::memory_order_acq_rel)) return front ? first : last - 1;
      }
    }
  };
  struct Shared {
    explicit Shared(int size) : size(size), runs(size) {}
    const int size;
    std::vector<Run> runs;
    std::atomic<int> arrived{0}, generation{0};
    std::atomic<bool> broken{false};
    std::mutex mu;
    std::exception_ptr error;
    void fail(std::exception_ptr e) {
      std::lock_guard<std::mutex> lock(mu);
      if (!error) error = e;
      broken.store(true, std::memory_order_relaxed);
    }
  };

  Gang(Shared& shared, int index) : shared_(shared), index_(index) {}

  static thread_local Gang* current_;
  Shared& shared_;
  const int index_;
};

thread_local Gang* Gang::current_ = nullptr;

// Runs fn(i0, i1, thread) over [0, n) in pieces of `piece`, the team's threads (numbered
// from 0, the caller) taking the next piece as they finish; inline (thread 0) unless
// `parallel`. Within a gang, each of its threads its own run of the pieces (`Gang::split`).
template <typename F>
void share(int64_t n, int64_t piece, bool parallel, const F& fn) {
  if (Gang* gang = Gang::current()) return gang->split(n, piece, fn);
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
int64_t team_threads() {
  if (const Gang* gang = Gang::current()) return gang->size();
  return std::min<int64_t>(Team::get().size(), at::get_num_threads());
}

// Rows a piece of a GEMV streaming N rows of K weights: a quarter of each thread's share
// (long runs of rows for the weights' prefetch; a slow thread's rest taken by the others),
// at least PIECE weights, a multiple of 4. Zen 1: ~1.3x the speed of PIECE-weight pieces.
int64_t stream_piece(int64_t N, int64_t K) {
  return std::max({int64_t{4}, PIECE / K / 4 * 4, N / (4 * team_threads()) / 4 * 4});
}

}  // namespace
