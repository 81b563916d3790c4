#include <gtest/gtest.h>

#include <cstdio>

#include "test_util.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  std::printf("FLAME tests on %s\n", flame::test::test_device().str().c_str());
  return RUN_ALL_TESTS();
}
