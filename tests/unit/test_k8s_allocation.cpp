// pvgpud's reading of a Kubernetes pod's allocation file (issue 55): what
// the text says, the file as a process sees it, and the [kubernetes] key.
#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "daemon/config.hpp"
#include "daemon/k8s_allocation.hpp"

using namespace pvgpu::daemon;
namespace fs = std::filesystem;

namespace {

// The error for `text` on a host of 2 GPUs ("" when it parses).
std::string parse_error(const std::string& text) {
    const AllocationParse p = parse_allocation(text, 2);
    CHECK(p.gpu.has_value() == p.error.empty());
    return p.error;
}

struct TempDir {
    fs::path path;
    TempDir() {
        char tmpl[] = "/tmp/pvgpu-k8s-alloc-XXXXXX";
        REQUIRE(::mkdtemp(tmpl) != nullptr);
        path = tmpl;
    }
    ~TempDir() {
        std::error_code ec;
        fs::remove_all(path, ec);
    }
};

}  // namespace

TEST_CASE("k8s allocation: a valid file names its GPU", "[daemon][kubernetes]") {
    CHECK(parse_allocation(R"({"gpu": 1, "units": 25, "devices": ["gpu1-u000"]})", 2).gpu == 1u);
    CHECK(parse_allocation(R"({"gpu":0})", 2).gpu == 0u);
    // Fields pvgpud does not know are left alone (a later plugin may add some).
    CHECK(parse_allocation(R"({"units": "many", "gpu": 1, "extra": {"x": [1, 2]}})", 2).gpu == 1u);
}

TEST_CASE("k8s allocation: a wrong file is an error saying what is wrong", "[daemon][kubernetes]") {
    CHECK_THAT(parse_error(""), Catch::Contains("malformed JSON"));
    CHECK_THAT(parse_error(R"({"gpu": 1)"), Catch::Contains("malformed JSON"));
    CHECK_THAT(parse_error("gpu=1"), Catch::Contains("malformed JSON"));
    CHECK_THAT(parse_error("[1]"), Catch::Contains("not a JSON object"));
    CHECK_THAT(parse_error(R"({"units": 25})"), Catch::Contains("no \"gpu\""));
    CHECK_THAT(parse_error(R"({"gpu": "1"})"), Catch::Contains("not an integer"));
    CHECK_THAT(parse_error(R"({"gpu": 1.5})"), Catch::Contains("not an integer"));
    CHECK_THAT(parse_error(R"({"gpu": null})"), Catch::Contains("not an integer"));
    CHECK_THAT(parse_error(R"({"gpu": 1e30})"), Catch::Contains("not an integer"));
    CHECK_THAT(parse_error(R"({"gpu": -1})"), Catch::Contains("negative (-1)"));
    CHECK_THAT(parse_error(R"({"gpu": 2})"), Catch::Contains("\"gpu\" is 2; this host has 2 GPUs"));
    CHECK_THAT(parse_error(R"({"gpu": 4294967296})"), Catch::Contains("this host has 2 GPUs"));
    CHECK_THAT(parse_error(R"({"gpu": 18446744073709551615})"), Catch::Contains("this host has 2 GPUs"));
    CHECK_THAT(parse_error(std::string(R"({"gpu": 1, "pad": ")") + std::string(4096, 'x') + "\"}"),
               Catch::Contains("larger than 4096 bytes"));
}

TEST_CASE("k8s allocation: the file as a process sees it", "[daemon][kubernetes]") {
    TempDir t;
    const pid_t self = ::getpid();
    const std::string file = (t.path / "allocation.json").string();
    CHECK(read_allocation_file(self, file).kind == AllocationRead::Kind::Absent);
    CHECK(read_allocation_file(self, file + "/below").kind == AllocationRead::Kind::Absent);
    std::ofstream(file) << R"({"gpu": 1})";
    AllocationRead r = read_allocation_file(self, file);
    CHECK(r.kind == AllocationRead::Kind::Text);
    CHECK(r.text == R"({"gpu": 1})");
    // ENOTDIR: a path below a regular file names no allocation.
    CHECK(read_allocation_file(self, file + "/below").kind == AllocationRead::Kind::Absent);

    const std::string link = (t.path / "link.json").string();
    fs::create_symlink(file, link);
    r = read_allocation_file(self, link);
    CHECK(r.kind == AllocationRead::Kind::Error);
    CHECK_THAT(r.text, Catch::Contains("symbolic link"));

    r = read_allocation_file(self, t.path.string());
    CHECK(r.kind == AllocationRead::Kind::Error);
    CHECK_THAT(r.text, Catch::Contains("not a regular file"));

    // A process that is gone has no view to read: no reservation.
    const pid_t gone = ::fork();
    REQUIRE(gone >= 0);
    if (gone == 0) ::_exit(0);
    REQUIRE(::waitpid(gone, nullptr, 0) == gone);
    CHECK(read_allocation_file(gone, file).kind == AllocationRead::Kind::Absent);

    const std::string big = (t.path / "big.json").string();
    std::ofstream(big) << std::string(kMaxAllocationFileBytes + 1, ' ');
    r = read_allocation_file(self, big);
    CHECK(r.kind == AllocationRead::Kind::Error);
    CHECK_THAT(r.text, Catch::Contains("larger than 4096 bytes"));
}

TEST_CASE("config: [kubernetes] allocation_file", "[daemon][config][kubernetes]") {
    CHECK(parse_config("", "t.conf").kubernetes.allocation_file == "/run/pvgpu/allocation.json");
    CHECK(parse_config("[kubernetes]\nallocation_file=\n", "t.conf").kubernetes.allocation_file.empty());
    CHECK(parse_config("[kubernetes]\nallocation_file = /x/a.json\n", "t.conf").kubernetes.allocation_file ==
          "/x/a.json");
    for (const char* bad : {"relative.json", "/run/pvgpu/"}) {
        try {
            parse_config(std::string("[kubernetes]\nallocation_file=") + bad + "\n", "t.conf");
            FAIL("accepted allocation_file=" << bad);
        } catch (const ConfigError& e) {
            CHECK_THAT(e.what(), Catch::Contains("t.conf:2") && Catch::Contains("[kubernetes] allocation_file"));
        }
    }
}
