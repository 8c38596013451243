// Stream workers: the one kind of work that runs asynchronously is a non_blocking copy.
//
// NOTE: [What runs asynchronously]
// Every op runs when it is called, on the calling thread, after the work queued on the current
// stream of its device has finished (so each stream stays in order). A copy with
// non_blocking=True is the exception: it is queued on the current stream's worker thread and runs
// later, after an optional delay (set_copy_delay), exactly as a host<->device copy on a side
// stream runs behind the host on a GPU. So the synchronization offloading needs is observable:
// reading a copy's destination before waiting on its event or stream sees the old values, and a
// device block freed while a queued copy still reads it reads poison (allocator.cpp) unless the
// stream was recorded on it (Tensor.record_stream). Events are recorded by queueing a marker;
// making a stream wait on an event queues a wait on that stream's worker (or, for work that runs on
// the calling thread, waits there).
//
// NOTE: [The copy and compute model]
// For timing, the device can be told how fast it is: a bandwidth for each direction of a copy
// between the device and host memory, and a compute scale. A host<->device copy of N bytes at B
// bytes/s then takes at least N / B seconds on its stream: after the copy itself, its stream's
// worker (or, for a blocking copy, the calling thread) waits until N / B seconds have passed since
// the copy began, so a copy is never shorter than the modelled time and is longer only where the
// memcpy itself is. Work queued behind it on that stream waits with it; other streams do not
// (a stream that waits on its event does). Every kernel takes its CPU time times the compute scale
// (kernels.cpp), so that the ratio of copy to compute time can be set to a GPU's. The copy delay
// (set_copy_delay) is separate: it makes races certain in tests, and adds to the modelled time.
// No bandwidth set (0) leaves copies as fast as the memcpy; a scale of 1 leaves kernels as they are.
//
// NOTE: [A copy delay that starts at the wait]
// A delay counted from when the copy was queued hides behind whatever the host does before it
// waits: on a loaded machine the host can take longer than the delay, and a test that expects the
// wait to be exposed fails by chance. With set_copy_delay(..., from_wait=True) a queued copy is held
// until something waits on its stream (a stream or the host waiting on an event recorded there, or
// a synchronize) and only then waits out the delay, so every wait on it lasts at least the delay.
// A copy nobody waits on stays queued (its events never complete); synchronizing releases it.
//
// NOTE: [An event's time is when its stream reached it]
// A GPU stamps an event when the stream reaches it: at once on an idle stream, else when the work
// ahead of it ends. A worker thread runs a marker only when the scheduler next gives it a core,
// which on a loaded machine can be tens of milliseconds later, and an event stamped then would
// shorten every wait measured from it. So a marker is stamped with the later of the time it was
// recorded and the time its stream finished the work ahead of it, never with the time its worker
// happened to run.
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "accelerator.h"

namespace sac_test_accelerator {
namespace {

std::atomic<int64_t> copy_delay_us{0};
std::atomic<bool> copy_delay_from_wait{false};  // NOTE: [A copy delay that starts at the wait]
// Bytes per second; 0: not modelled (NOTE: [The copy and compute model]).
std::atomic<double> bandwidth_to_host{0.0};
std::atomic<double> bandwidth_to_device{0.0};
std::atomic<double> compute_scale_factor{1.0};

// One worker thread per stream that ever had work queued. Never destroyed: the threads are
// detached and may still be waiting when the process exits.
class Worker {
 public:
  Worker() {
    std::thread([this] { run(); }).detach();
  }

  void enqueue(std::function<void()> work) { push({std::move(work), nullptr, {}}); }

  // NOTE: [An event's time is when its stream reached it]
  void enqueue_marker(std::function<void(std::chrono::steady_clock::time_point)> reached) {
    push({nullptr, std::move(reached), std::chrono::steady_clock::now()});
  }

  void drain() {
    note_wait();  // a synchronize is a wait: it releases held copies
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [this] { return queue_.empty() && !running_; });
  }

  // The waits on this stream so far (NOTE: [A copy delay that starts at the wait]).
  uint64_t waits() {
    std::lock_guard<std::mutex> lock(mutex_);
    return waits_;
  }

  void note_wait() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++waits_;
    }
    changed_.notify_all();
  }

  // Called by queued work on the worker thread: returns once a wait came after `seen`.
  void hold_until_a_wait_after(uint64_t seen) {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return waits_ > seen; });
  }

  bool idle() {
    std::lock_guard<std::mutex> lock(mutex_);
    return queue_.empty() && !running_;
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      changed_.wait(lock, [this] { return !queue_.empty(); });
      Item item = std::move(queue_.front());
      queue_.pop_front();
      running_ = true;
      lock.unlock();
      if (item.marker) {
        finished_at_ = std::max(finished_at_, item.recorded_at);
        item.marker(finished_at_);
      } else {
        item.work();  // the queued work is ours: it reports no errors (the copies were checked when queued)
        finished_at_ = std::chrono::steady_clock::now();
      }
      item = Item{};  // what it holds (a host tensor) is released before the queue is locked again
      lock.lock();
      running_ = false;
      changed_.notify_all();
    }
  }

  // Queued work, or a marker: called with the time the stream reached it.
  struct Item {
    std::function<void()> work;
    std::function<void(std::chrono::steady_clock::time_point)> marker;
    std::chrono::steady_clock::time_point recorded_at;
  };

  void push(Item item) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(item));
    }
    changed_.notify_all();
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Item> queue_;
  // When the stream finished its last work: the worker's own, read and written only by it.
  std::chrono::steady_clock::time_point finished_at_;
  bool running_ = false;
  uint64_t waits_ = 0;
};

struct Workers {
  std::mutex mutex;
  std::map<std::pair<c10::DeviceIndex, c10::StreamId>, Worker*> by_stream;
};

Workers& workers() {
  static auto* all = new Workers();
  return *all;
}

Worker* find_worker(const c10::Stream& stream) {
  Workers& all = workers();
  std::lock_guard<std::mutex> lock(all.mutex);
  auto found = all.by_stream.find({stream.device_index(), stream.id()});
  return found == all.by_stream.end() ? nullptr : found->second;
}

Worker& worker_for(const c10::Stream& stream) {
  Workers& all = workers();
  std::lock_guard<std::mutex> lock(all.mutex);
  Worker*& worker = all.by_stream[{stream.device_index(), stream.id()}];
  if (worker == nullptr) {
    worker = new Worker();
  }
  return *worker;
}

}  // namespace

void enqueue_on_stream(const c10::Stream& stream, std::function<void()> work) {
  worker_for(stream).enqueue(std::move(work));
}

void enqueue_marker_on_stream(const c10::Stream& stream,
                              std::function<void(std::chrono::steady_clock::time_point)> reached) {
  worker_for(stream).enqueue_marker(std::move(reached));
}

void enqueue_copy_on_stream(const c10::Stream& stream, std::function<void()> copy, size_t bytes,
                            CopyDirection direction) {
  Worker& worker = worker_for(stream);
  const bool from_wait = copy_delay_from_wait.load();
  const uint64_t waits_before = from_wait ? worker.waits() : 0;
  worker.enqueue([&worker, copy = std::move(copy), bytes, direction, from_wait, waits_before] {
    int64_t delay = copy_delay_us.load();
    if (from_wait) {
      worker.hold_until_a_wait_after(waits_before);
    }
    if (delay > 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(delay));
    }
    run_modelled_copy(copy, bytes, direction);
  });
}

void run_modelled_copy(const std::function<void()>& copy, size_t bytes, CopyDirection direction) {
  const auto started = std::chrono::steady_clock::now();
  copy();
  if (direction == CopyDirection::kWithinDevice) {
    return;
  }
  const double bandwidth = (direction == CopyDirection::kToHost ? bandwidth_to_host : bandwidth_to_device).load();
  if (bandwidth > 0 && bytes > 0) {
    std::this_thread::sleep_until(started + std::chrono::duration<double>(static_cast<double>(bytes) / bandwidth));
  }
}

void note_waited(const c10::Stream& stream) {
  if (Worker* worker = find_worker(stream)) {
    worker->note_wait();
  }
}

void synchronize_stream(const c10::Stream& stream) {
  if (Worker* worker = find_worker(stream)) {
    worker->drain();
  }
}

bool stream_idle(const c10::Stream& stream) {
  Worker* worker = find_worker(stream);
  return worker == nullptr || worker->idle();
}

std::vector<c10::Stream> busy_streams() {
  std::vector<c10::Stream> busy;
  Workers& all = workers();
  std::lock_guard<std::mutex> lock(all.mutex);
  for (const auto& [key, worker] : all.by_stream) {
    if (!worker->idle()) {
      busy.emplace_back(c10::Stream::UNSAFE, c10::Device(c10::DeviceType::PrivateUse1, key.first), key.second);
    }
  }
  return busy;
}

void synchronize_device(c10::DeviceIndex device) {
  std::vector<Worker*> on_device;
  {
    Workers& all = workers();
    std::lock_guard<std::mutex> lock(all.mutex);
    for (const auto& [key, worker] : all.by_stream) {
      if (key.first == device) {
        on_device.push_back(worker);
      }
    }
  }
  for (Worker* worker : on_device) {
    worker->drain();
  }
}

void set_copy_delay_us(int64_t microseconds, bool from_wait) {
  TORCH_CHECK(microseconds >= 0, "sac_test_accelerator: the copy delay must be >= 0 microseconds, got ", microseconds);
  copy_delay_us.store(microseconds);
  copy_delay_from_wait.store(from_wait);
}

void set_copy_bandwidth(double to_host, double to_device) {
  TORCH_CHECK(
      to_host >= 0 && to_device >= 0 && std::isfinite(to_host) && std::isfinite(to_device),
      "sac_test_accelerator: copy bandwidths must be finite numbers of bytes per second >= 0 (0: not modelled), "
      "got ",
      to_host, " to the host and ", to_device, " to the device");
  bandwidth_to_host.store(to_host);
  bandwidth_to_device.store(to_device);
}

void set_compute_scale(double scale) {
  TORCH_CHECK(scale >= 1 && std::isfinite(scale),
              "sac_test_accelerator: the compute scale must be a finite number >= 1 (kernels cannot run faster "
              "than the CPU runs them), got ",
              scale);
  compute_scale_factor.store(scale);
}

std::vector<double> simulation_parameters() {
  return {bandwidth_to_host.load(), bandwidth_to_device.load(), compute_scale_factor.load()};
}

double compute_scale() { return compute_scale_factor.load(); }

void wait_out_compute_scale(std::chrono::steady_clock::time_point started, double scale) {
  // A kernel of t seconds ends (scale - 1) * t later. Sleeping overshoots by tens of
  // microseconds, more than many small kernels take, so the last stretch spins.
  const auto took = std::chrono::steady_clock::now() - started;
  const auto until = started + std::chrono::duration_cast<std::chrono::steady_clock::duration>(took * scale);
  constexpr auto kSpin = std::chrono::microseconds(200);
  if (until - std::chrono::steady_clock::now() > kSpin) {
    std::this_thread::sleep_until(until - kSpin);
  }
  while (std::chrono::steady_clock::now() < until) {
  }
}

}  // namespace sac_test_accelerator
