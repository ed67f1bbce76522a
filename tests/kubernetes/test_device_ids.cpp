// pvgpu-device-plugin's device IDs and its one-GPU allocation rules
// (scheduler/kubernetes/device_ids.hpp).
#include <catch2/catch.hpp>

#include "device_ids.hpp"

using namespace pvgpu::k8s;

namespace {

std::vector<std::string> ids(unsigned gpu, unsigned from, unsigned to) {
    std::vector<std::string> v;
    for (unsigned u = from; u < to; ++u) v.push_back(device_id({gpu, u}));
    return v;
}

std::vector<std::string> operator+(std::vector<std::string> a, const std::vector<std::string>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
}

}  // namespace

TEST_CASE("device IDs name 100 units per GPU, one spelling each", "[kubernetes]") {
    const auto all = all_device_ids(2);
    REQUIRE(all.size() == 200);
    CHECK(all.front() == "gpu0-u000");
    CHECK(all[99] == "gpu0-u099");
    CHECK(all[100] == "gpu1-u000");
    CHECK(all.back() == "gpu1-u099");
    for (const auto& id : all) CHECK(device_id(*parse_device_id(id)) == id);
    CHECK(parse_device_id("gpu12-u042") == Unit{12, 42});
    for (const char* bad : {"gpu0-u100", "gpu0-u01", "gpu0-u0001", "gpu01-u000", "gpu-u000", "gpu0u000",
                            "cpu0-u000", "gpu0-u00x", "gpu0-u-01", ""})
        CHECK_FALSE(parse_device_id(bad).has_value());
}

TEST_CASE("a preferred allocation comes from the GPU with the most free units that fits", "[kubernetes]") {
    // GPU 0: 30 free, GPU 1: 60 free, GPU 2: 20 free.
    const auto available = ids(0, 70, 100) + ids(1, 40, 100) + ids(2, 0, 20);
    CHECK(preferred_allocation(available, {}, 25) == ids(1, 40, 65));
    CHECK(preferred_allocation(available, {}, 60) == ids(1, 40, 100));
    // The lowest index on a tie.
    CHECK(preferred_allocation(ids(0, 0, 50) + ids(1, 0, 50), {}, 10) == ids(0, 0, 10));
    // No GPU has 61 free: refused rather than split.
    try {
        preferred_allocation(available, {}, 61);
        FAIL("61 units were split across GPUs");
    } catch (const AllocationError& e) {
        CHECK(e.exhausted);
        CHECK(e.message.find("no GPU has 61 free units (the most free on one GPU: 60)") != std::string::npos);
    }
}

TEST_CASE("a preferred allocation honours must_include", "[kubernetes]") {
    const auto available = ids(0, 0, 100) + ids(1, 0, 100);
    const auto got = preferred_allocation(available, {"gpu1-u077", "gpu1-u003"}, 5);
    CHECK(got == std::vector<std::string>{"gpu1-u077", "gpu1-u003", "gpu1-u000", "gpu1-u001", "gpu1-u002"});
    // Kubelet may leave must_include out of the available IDs.
    CHECK(preferred_allocation(ids(0, 10, 20), {"gpu0-u000"}, 3) ==
          std::vector<std::string>{"gpu0-u000", "gpu0-u010", "gpu0-u011"});
    CHECK_THROWS_AS(preferred_allocation(available, {"gpu0-u000", "gpu1-u000"}, 5), AllocationError);
    CHECK_THROWS_AS(preferred_allocation(ids(0, 0, 3), {"gpu0-u000"}, 5), AllocationError);
    CHECK_THROWS_AS(preferred_allocation(available, {}, 0), AllocationError);
    CHECK_THROWS_AS(preferred_allocation({"nvidia0"}, {}, 1), AllocationError);
}

TEST_CASE("Allocate grants one GPU's units and refuses the rest", "[kubernetes]") {
    const Grant g = grant_for(ids(1, 10, 40), 2);
    CHECK(g.gpu == 1);
    CHECK(g.units == 30);
    try {
        grant_for(ids(0, 0, 5) + ids(1, 0, 1), 2);
        FAIL("units across GPUs were granted");
    } catch (const AllocationError& e) {
        CHECK(e.message == "units of one container must come from one GPU: gpu0-u000 is on GPU 0, gpu1-u000 on GPU 1");
    }
    CHECK_THROWS_AS(grant_for(ids(2, 0, 5), 2), AllocationError);  // pvgpud has 2 GPUs
    CHECK_THROWS_AS(grant_for({"gpu0-u001", "gpu0-u001"}, 2), AllocationError);
    CHECK_THROWS_AS(grant_for({}, 2), AllocationError);
}
