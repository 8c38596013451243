#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "ops/per_thread.h"

namespace sac {
namespace {

// NOTE: [One lookup per thread-local object]
struct Counted {
  static inline std::atomic<int> built{0};
  static inline std::atomic<int> destroyed{0};
  Counted() { built.fetch_add(1); }
  ~Counted() { destroyed.fetch_add(1); }
  int value = 0;
};

TEST(PerThreadTest, OneObjectPerThreadBuiltOnFirstUseAndDestroyedAtThreadExit) {
  Counted& mine = PerThread<Counted>::get();
  mine.value = 7;
  EXPECT_EQ(&PerThread<Counted>::get(), &mine);
  const int built = Counted::built.load();
  const int destroyed = Counted::destroyed.load();
  const Counted* theirs = nullptr;
  int their_value = -1;
  std::thread other([&] {
    theirs = &PerThread<Counted>::get();
    their_value = PerThread<Counted>::get().value;
  });
  other.join();
  EXPECT_NE(theirs, &mine);
  EXPECT_EQ(their_value, 0);  // a fresh object, not this thread's
  EXPECT_EQ(Counted::built.load(), built + 1);
  EXPECT_EQ(Counted::destroyed.load(), destroyed + 1);  // when its thread ended
  EXPECT_EQ(PerThread<Counted>::get().value, 7);
}

}  // namespace
}  // namespace sac
