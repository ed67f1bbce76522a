// Configure-time probe: can clang++ link a libFuzzer target with ASan/UBSan?
// (Debian: needs libclang-rt-14-dev.)
#include <cstddef>
#include <cstdint>
extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t*, std::size_t) { return 0; }
