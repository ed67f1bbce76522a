// The binary wire protocol: encoding, reassembly, validation, fd passing.
#include <catch2/catch.hpp>

#include "proto/wire.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using namespace pvgpu;
using namespace pvgpu::wire;

namespace {

using Bytes = std::vector<std::byte>;

template <class T> std::span<const std::byte> bytes_of(const T& t) {
    return std::as_bytes(std::span<const T, 1>(&t, 1));
}

void append(Bytes& out, const Bytes& b) { out.insert(out.end(), b.begin(), b.end()); }

UniqueFd make_eventfd() {
    UniqueFd fd(::eventfd(0, EFD_CLOEXEC));
    REQUIRE(fd);
    return fd;
}

UniqueFd make_memfd(std::size_t size) {
    UniqueFd fd(::memfd_create("pvgpu-test", MFD_CLOEXEC));
    REQUIRE(fd);
    REQUIRE(::ftruncate(fd.get(), static_cast<off_t>(size)) == 0);
    return fd;
}

bool fd_open(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

bool fd_closed(int fd) {
    errno = 0;
    return ::fcntl(fd, F_GETFD) == -1 && errno == EBADF;
}

int count_open_fds() {
    int n = 0;
    DIR* d = ::opendir("/proc/self/fd");
    REQUIRE(d != nullptr);
    while (::readdir(d) != nullptr) ++n;
    ::closedir(d);
    return n;
}

struct SocketPair {
    UniqueFd a, b;
    SocketPair() {
        int sv[2];
        REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) == 0);
        a.reset(sv[0]);
        b.reset(sv[1]);
    }
};

// A valid body for every message type.
pvgpu_hello hello_body() {
    pvgpu_hello h{};
    h.version = PVGPU_PROTO_VERSION;
    h.role = PVGPU_ROLE_VMM;
    for (int i = 0; i < 16; ++i) h.uuid[i] = static_cast<pvgpu_u8>(i + 1);
    set_name(h.name, sizeof h.name, "vm1");
    h.pid = 4242;
    return h;
}
pvgpu_chan_alloc alloc_body() {
    pvgpu_chan_alloc a{};
    a.pid_hint = 1234;
    set_name(a.task_name, sizeof a.task_name, "bench");
    return a;
}
pvgpu_hello_reply hello_reply_body() { return {PVGPU_OK, 1, 7, 16}; }
pvgpu_chan_reply chan_reply_ok() { return {PVGPU_OK, 3, PVGPU_CHAN_MEM_SIZE, PVGPU_MODE_DIRECT}; }
pvgpu_chan_reply chan_reply_err() { return {PVGPU_E_LIMIT, 0, 0, 0}; }
pvgpu_mode mode_body() { return {3, PVGPU_MODE_SHADOWED, 9, 0}; }
pvgpu_mode_ack mode_ack_body() { return {3, PVGPU_MODE_TRAPPED, 10, 77}; }
pvgpu_notice notice_body() { return {PVGPU_NOTICE_WATCHDOG, 3, 1234}; }
pvgpu_task_weight task_weight_body() { return {0x1'0000'0042, 250, 0}; }
pvgpu_error error_body() {
    pvgpu_error e{};
    e.status = PVGPU_E_STATE;
    set_name(e.message, sizeof e.message, "HELLO first");
    return e;
}

struct Sample {
    std::uint16_t type;
    Bytes payload;
    std::size_t nfds;  // fds the message must carry
};

template <class T> Bytes body(const T& t) {
    auto s = bytes_of(t);
    return Bytes(s.begin(), s.end());
}

std::vector<Sample> all_samples() {
    return {
        {PVGPU_MSG_HELLO, body(hello_body()), 0},
        {PVGPU_MSG_CHAN_ALLOC, body(alloc_body()), 0},
        {PVGPU_MSG_CHAN_FREE, body(pvgpu_chan_ref{3, 0}), 0},
        {PVGPU_MSG_MODE_ACK, body(mode_ack_body()), 0},
        {PVGPU_MSG_TRAP_REPORT, body(pvgpu_trap_report{3, 12}), 0},
        {PVGPU_MSG_PING, {}, 0},
        {PVGPU_MSG_TASK_WEIGHT, body(task_weight_body()), 0},
        {PVGPU_MSG_HELLO_REPLY, body(hello_reply_body()), 0},
        {PVGPU_MSG_CHAN_REPLY, body(chan_reply_ok()), 2},
        {PVGPU_MSG_CHAN_REPLY, body(chan_reply_err()), 0},
        {PVGPU_MSG_FREE_REPLY, body(pvgpu_status_reply{PVGPU_E_NOENT, 5}), 0},
        {PVGPU_MSG_MODE, body(mode_body()), 0},
        {PVGPU_MSG_NOTICE, body(notice_body()), 0},
        {PVGPU_MSG_ERROR, body(error_body()), 0},
        {PVGPU_MSG_PONG, {}, 0},
        {PVGPU_MSG_TASK_WEIGHT_REPLY, body(pvgpu_status_reply{PVGPU_E_LIMIT, 0}), 0},
    };
}

std::vector<UniqueFd> two_fds() {
    std::vector<UniqueFd> v;
    v.push_back(make_memfd(PVGPU_CHAN_MEM_SIZE));
    v.push_back(make_eventfd());
    return v;
}

// Drains the reader: messages until nothing more, or the error.
struct Drained {
    std::vector<Message> messages;
    std::optional<std::string> error;
};
void drain(Reader& r, Drained& out) {
    while (true) {
        auto v = r.next();
        if (std::holds_alternative<std::monostate>(v)) return;
        if (auto* e = std::get_if<DecodeError>(&v)) {
            out.error = e->reason;
            return;
        }
        out.messages.push_back(std::move(std::get<Message>(v)));
    }
}

std::string reader_error(const Bytes& stream, std::vector<UniqueFd> fds = {}) {
    Reader r;
    r.feed(stream, std::move(fds));
    Drained d;
    drain(r, d);
    return d.error.value_or("<no error>");
}

pvgpu_msg_hdr header(std::uint16_t type, std::uint32_t len, std::uint32_t seq = 1) {
    pvgpu_msg_hdr h{};
    h.magic = PVGPU_PROTO_MAGIC;
    h.type = type;
    h.len = len;
    h.seq = seq;
    return h;
}

template <class T> std::optional<std::string> check(std::uint16_t type, const T& t, std::size_t nfds = 0) {
    return validate(header(type, sizeof(T)), bytes_of(t), nfds);
}

}  // namespace

TEST_CASE("wire: every message type round-trips", "[wire]") {
    std::uint32_t seq = 100;
    for (const auto& s : all_samples()) {
        INFO(type_name(s.type));
        const Bytes encoded = encode(s.type, seq, s.payload);
        REQUIRE(encoded.size() == sizeof(pvgpu_msg_hdr) + s.payload.size());

        Reader r;
        r.feed(encoded, s.nfds ? two_fds() : std::vector<UniqueFd>{});
        auto v = r.next();
        REQUIRE(std::holds_alternative<Message>(v));
        const auto& m = std::get<Message>(v);
        CHECK(m.hdr.magic == PVGPU_PROTO_MAGIC);
        CHECK(m.hdr.type == s.type);
        CHECK(m.hdr.flags == 0);
        CHECK(m.hdr.len == s.payload.size());
        CHECK(m.hdr.seq == seq);
        CHECK(m.payload == s.payload);
        CHECK(m.fds.size() == s.nfds);
        CHECK_FALSE(validate(m.hdr, m.payload, m.fds.size()));
        // Re-encoding the decoded message gives the same bytes.
        CHECK(encode(m.hdr.type, m.hdr.seq, m.payload) == encoded);
        CHECK(std::holds_alternative<std::monostate>(r.next()));
        CHECK(r.buffered() == 0);
        ++seq;
    }
}

TEST_CASE("wire: typed payload access", "[wire]") {
    Reader r;
    r.feed(encode(PVGPU_MSG_HELLO, 1, hello_body()));
    auto v = r.next();
    REQUIRE(std::holds_alternative<Message>(v));
    const auto h = std::get<Message>(v).as<pvgpu_hello>();
    CHECK(h.version == PVGPU_PROTO_VERSION);
    CHECK(h.role == PVGPU_ROLE_VMM);
    CHECK(h.pid == 4242);
    CHECK(name_of(h.name, sizeof h.name) == "vm1");
    CHECK(h.uuid[15] == 16);
}

TEST_CASE("wire: messages split at every byte boundary", "[wire]") {
    // The fd-carrying CHAN_REPLY comes last: a sender never puts bytes of a
    // later message into the sendmsg() that carries fds (see Reader::feed).
    Bytes stream;
    std::size_t fd_msg_at = 0;
    const auto samples = all_samples();
    std::size_t n = 0;
    for (const auto& s : samples) {
        if (s.nfds) continue;
        append(stream, encode(s.type, static_cast<std::uint32_t>(n++), s.payload));
    }
    fd_msg_at = stream.size();
    append(stream, encode(PVGPU_MSG_CHAN_REPLY, 999, chan_reply_ok()));
    const std::size_t total = n + 1;

    for (std::size_t k = 0; k <= stream.size(); ++k) {
        Reader r;
        Drained d;
        const auto first = std::span<const std::byte>(stream).first(k);
        const auto second = std::span<const std::byte>(stream).subspan(k);
        r.feed(first, k > fd_msg_at ? two_fds() : std::vector<UniqueFd>{});
        drain(r, d);
        r.feed(second, k <= fd_msg_at ? two_fds() : std::vector<UniqueFd>{});
        drain(r, d);
        INFO("split at " << k);
        REQUIRE_FALSE(d.error);
        REQUIRE(d.messages.size() == total);
        CHECK(d.messages.back().hdr.seq == 999);
        CHECK(d.messages.back().fds.size() == 2);
        for (std::size_t i = 0; i + 1 < total; ++i) CHECK(d.messages[i].fds.empty());
        CHECK(r.buffered() == 0);
    }

    SECTION("one byte at a time") {
        Reader r;
        Drained d;
        for (std::size_t i = 0; i < stream.size(); ++i) {
            r.feed(std::span<const std::byte>(stream).subspan(i, 1),
                   i == fd_msg_at ? two_fds() : std::vector<UniqueFd>{});
            drain(r, d);
            CHECK(r.buffered() <= sizeof(pvgpu_msg_hdr) + PVGPU_PROTO_MAX_PAYLOAD);
        }
        REQUIRE_FALSE(d.error);
        REQUIRE(d.messages.size() == total);
        CHECK(d.messages.back().fds.size() == 2);
    }
}

TEST_CASE("wire: many messages in one chunk", "[wire]") {
    Bytes stream;
    const auto samples = all_samples();
    std::uint32_t count = 0;
    for (int round = 0; round < 50; ++round)
        for (const auto& s : samples)
            if (!s.nfds) append(stream, encode(s.type, count++, s.payload));
    Reader r;
    r.feed(stream);
    Drained d;
    drain(r, d);
    REQUIRE_FALSE(d.error);
    REQUIRE(d.messages.size() == count);
    for (std::uint32_t i = 0; i < count; ++i) CHECK(d.messages[i].hdr.seq == i);
    CHECK(r.buffered() == 0);
}

TEST_CASE("wire: a whole message plus a partial one", "[wire]") {
    Bytes stream = encode(PVGPU_MSG_PING, 1);
    const Bytes hello = encode(PVGPU_MSG_HELLO, 2, hello_body());
    stream.insert(stream.end(), hello.begin(), hello.begin() + 40);
    Reader r;
    r.feed(stream);
    Drained d;
    drain(r, d);
    REQUIRE(d.messages.size() == 1);
    CHECK(r.buffered() == 40);
    r.feed(std::span<const std::byte>(hello).subspan(40));
    drain(r, d);
    REQUIRE(d.messages.size() == 2);
    CHECK(d.messages[1].hdr.type == PVGPU_MSG_HELLO);
}

TEST_CASE("wire: header rules", "[wire][validate]") {
    const Bytes ping = encode(PVGPU_MSG_PING, 1);

    SECTION("bad magic") {
        auto h = header(PVGPU_MSG_PING, 0);
        h.magic = 0x12345678;
        CHECK_THAT(*validate(h, {}, 0), Catch::Contains("bad magic 0x12345678"));
        CHECK_THAT(reader_error(body(h)), Catch::Contains("bad magic"));
    }
    SECTION("unknown types") {
        for (std::uint16_t t : {0, 11, 63, 74, 0xffff}) {
            auto h = header(t, 0);
            CHECK_THAT(*validate(h, {}, 0), Catch::Contains("unknown message type " + std::to_string(t)));
            CHECK_THAT(reader_error(body(h)), Catch::Contains("unknown message type"));
        }
    }
    SECTION("flags") {
        auto h = header(PVGPU_MSG_PING, 0);
        h.flags = 1;
        CHECK_THAT(*validate(h, {}, 0), Catch::Contains("PING (seq 1): flags 0x00000001 are not zero"));
        CHECK_THAT(reader_error(body(h)), Catch::Contains("flags"));
    }
    SECTION("len must match the type") {
        CHECK_THAT(*validate(header(PVGPU_MSG_PING, 4), Bytes(4), 0),
                   Catch::Contains("PING (seq 1): len 4, expected 0"));
        CHECK_THAT(*validate(header(PVGPU_MSG_HELLO, 95), Bytes(95), 0),
                   Catch::Contains("len 95, expected 96"));
        CHECK_THAT(*validate(header(PVGPU_MSG_ERROR, 129), Bytes(129), 0),
                   Catch::Contains("len 129, expected 128"));
        Bytes s = body(header(PVGPU_MSG_PONG, 8));
        s.resize(s.size() + 8);
        CHECK_THAT(reader_error(s), Catch::Contains("PONG (seq 1): len 8, expected 0"));
    }
    SECTION("len over the maximum") {
        CHECK_THAT(*validate(header(PVGPU_MSG_HELLO, PVGPU_PROTO_MAX_PAYLOAD + 1), {}, 0),
                   Catch::Contains("exceeds the maximum payload 1024"));
    }
    SECTION("payload size must equal len") {
        CHECK_THAT(*validate(header(PVGPU_MSG_HELLO, 96), Bytes(90), 0),
                   Catch::Contains("payload is 90 bytes, header says len 96"));
    }
    SECTION("too many fds") {
        CHECK_THAT(*validate(header(PVGPU_MSG_CHAN_REPLY, 16), bytes_of(chan_reply_ok()), 4),
                   Catch::Contains("more than the maximum 3"));
    }
    CHECK_FALSE(validate(header(PVGPU_MSG_PING, 0), {}, 0));
    CHECK(ping.size() == 16);
}

TEST_CASE("wire: payload rules", "[wire][validate]") {
    SECTION("fds only on an OK CHAN_REPLY") {
        CHECK_THAT(*check(PVGPU_MSG_HELLO, hello_body(), 1),
                   Catch::Contains("HELLO (seq 1): carries 1 fds; only CHAN_REPLY with status OK"));
        CHECK_THAT(*validate(header(PVGPU_MSG_PING, 0), {}, 2), Catch::Contains("only CHAN_REPLY"));
        CHECK_THAT(*check(PVGPU_MSG_MODE, mode_body(), 1), Catch::Contains("only CHAN_REPLY"));
        CHECK_THAT(*check(PVGPU_MSG_CHAN_REPLY, chan_reply_ok(), 0),
                   Catch::Contains("status OK needs 2 fds (memfd, doorbell eventfd) or 3 (and a completion "
                                   "notifier), got 0"));
        CHECK_THAT(*check(PVGPU_MSG_CHAN_REPLY, chan_reply_ok(), 1), Catch::Contains("got 1"));
        CHECK_THAT(*check(PVGPU_MSG_CHAN_REPLY, chan_reply_err(), 2),
                   Catch::Contains("carries 2 fds but status is not OK"));
        CHECK_THAT(*check(PVGPU_MSG_CHAN_REPLY, chan_reply_err(), 3),
                   Catch::Contains("carries 3 fds but status is not OK"));
        CHECK_FALSE(check(PVGPU_MSG_CHAN_REPLY, chan_reply_ok(), 2));
        CHECK_FALSE(check(PVGPU_MSG_CHAN_REPLY, chan_reply_ok(), 3));  // version 3, host client
        CHECK_FALSE(check(PVGPU_MSG_CHAN_REPLY, chan_reply_err(), 0));
    }
    SECTION("HELLO") {
        auto h = hello_body();
        h.version = 0;
        CHECK_THAT(*check(PVGPU_MSG_HELLO, h), Catch::Contains("version 0 is invalid"));
        h = hello_body();
        h.version = 7;  // newer clients are fine: the daemon negotiates down
        CHECK_FALSE(check(PVGPU_MSG_HELLO, h));
        for (std::uint32_t role : {0u, 3u, 0xffffffffu}) {
            h = hello_body();
            h.role = role;
            CHECK_THAT(*check(PVGPU_MSG_HELLO, h),
                       Catch::Contains("role " + std::to_string(role) + " is neither VMM (1) nor HOST (2)"));
        }
        h = hello_body();
        h.gpu = PVGPU_GPU_INDEX(PVGPU_MAX_GPUS - 1);
        CHECK_FALSE(check(PVGPU_MSG_HELLO, h));
        h.gpu = PVGPU_GPU_INDEX(PVGPU_MAX_GPUS);
        CHECK_THAT(*check(PVGPU_MSG_HELLO, h), Catch::Contains("gpu 17 is out of range"));
        h = hello_body();
        h.role = PVGPU_ROLE_HOST;
        CHECK_THAT(*check(PVGPU_MSG_HELLO, h), Catch::Contains("uuid must be zero for role HOST"));
        std::memset(h.uuid, 0, sizeof h.uuid);
        CHECK_FALSE(check(PVGPU_MSG_HELLO, h));
        h = hello_body();
        std::memset(h.uuid, 0, sizeof h.uuid);  // QEMU without -uuid
        CHECK_FALSE(check(PVGPU_MSG_HELLO, h));
        h = hello_body();
        std::memset(h.name, 'a', sizeof h.name);
        CHECK_THAT(*check(PVGPU_MSG_HELLO, h), Catch::Contains("name is not NUL-terminated within its 64 bytes"));
        h = hello_body();
        h.name[1] = '\n';
        CHECK_THAT(*check(PVGPU_MSG_HELLO, h),
                   Catch::Contains("name has a non-printable byte 0x0000000a at offset 1"));
        h = hello_body();
        h.name[0] = static_cast<char>(0xc3);
        CHECK_THAT(*check(PVGPU_MSG_HELLO, h), Catch::Contains("non-printable byte 0x000000c3"));
        h = hello_body();
        std::memset(h.name, 0, sizeof h.name);  // empty names are allowed
        CHECK_FALSE(check(PVGPU_MSG_HELLO, h));
    }
    SECTION("CHAN_ALLOC") {
        auto a = alloc_body();
        std::memset(a.task_name, 'x', sizeof a.task_name);
        CHECK_THAT(*check(PVGPU_MSG_CHAN_ALLOC, a),
                   Catch::Contains("CHAN_ALLOC (seq 1): task_name is not NUL-terminated within its 32 bytes"));
        a = alloc_body();
        a.task_name[0] = 0x7f;
        CHECK_THAT(*check(PVGPU_MSG_CHAN_ALLOC, a), Catch::Contains("task_name has a non-printable byte"));
    }
    SECTION("TASK_WEIGHT") {
        CHECK_FALSE(check(PVGPU_MSG_TASK_WEIGHT, task_weight_body()));
        auto t = task_weight_body();
        t.reserved = 1;
        CHECK_THAT(*check(PVGPU_MSG_TASK_WEIGHT, t),
                   Catch::Contains("TASK_WEIGHT (seq 1): reserved field is not zero"));
        // Out-of-range values are the daemon's to refuse in its reply
        // (E_INVALID): they must reach it, not end the connection.
        for (auto [hint, weight] : {std::pair<std::uint64_t, std::uint32_t>{0, 100},
                                    {1, 0},
                                    {1, PVGPU_WEIGHT_MAX + 1},
                                    {~0ull, 0xffffffffu}}) {
            t = {hint, weight, 0};
            CHECK_FALSE(check(PVGPU_MSG_TASK_WEIGHT, t));
        }
        CHECK_THAT(*validate(header(PVGPU_MSG_TASK_WEIGHT, 8), Bytes(8), 0),
                   Catch::Contains("TASK_WEIGHT (seq 1): len 8, expected 16"));
        CHECK_THAT(*check(PVGPU_MSG_TASK_WEIGHT, task_weight_body(), 1), Catch::Contains("only CHAN_REPLY"));
    }
    SECTION("migration (version 5)") {
        CHECK_FALSE(check(PVGPU_MSG_QUIESCE, pvgpu_quiesce{0, 0}, 1));
        CHECK_THAT(*check(PVGPU_MSG_QUIESCE, pvgpu_quiesce{0, 0}, 0),
                   Catch::Contains("QUIESCE (seq 1): needs 1 fd (the socket for its end), got 0"));
        CHECK_THAT(*check(PVGPU_MSG_QUIESCE, pvgpu_quiesce{0, 1}, 1), Catch::Contains("reserved field is not zero"));
        CHECK_FALSE(check(PVGPU_MSG_RESUME, pvgpu_chan_ref{0, 0}));
        CHECK_THAT(*check(PVGPU_MSG_RESUME, pvgpu_chan_ref{1, 0}), Catch::Contains("must be zero"));
        CHECK_THAT(*check(PVGPU_MSG_RESUME, pvgpu_chan_ref{0, 0}, 1), Catch::Contains("may carry fds"));
        pvgpu_chan_restore r{};
        r.pid_hint = 7;
        std::memcpy(r.task_name, "bench", 6);
        r.ib_put = 12;
        r.ib_get = 10;
        CHECK_FALSE(check(PVGPU_MSG_CHAN_RESTORE, r, 1));
        CHECK_THAT(*check(PVGPU_MSG_CHAN_RESTORE, r, 0), Catch::Contains("needs 1 fd (the saved channel memory)"));
        r.mode = 3;
        CHECK_THAT(*check(PVGPU_MSG_CHAN_RESTORE, r, 1), Catch::Contains("mode 3 is out of range"));
        r.mode = 0;
        std::memset(r.task_name, 'x', sizeof r.task_name);
        CHECK_THAT(*check(PVGPU_MSG_CHAN_RESTORE, r, 1), Catch::Contains("task_name is not NUL-terminated"));
        // Positions are the daemon's to refuse (E_INVALID in CHAN_REPLY).
        r = {};
        r.ib_put = 1000;
        CHECK_FALSE(check(PVGPU_MSG_CHAN_RESTORE, r, 1));
        for (std::uint16_t t : {PVGPU_MSG_QUIESCE_REPLY, PVGPU_MSG_RESUME_REPLY}) {
            CHECK_FALSE(check(t, pvgpu_status_reply{PVGPU_OK, 2}));
            CHECK_THAT(*check(t, pvgpu_status_reply{9, 0}), Catch::Contains("status 9 is unknown"));
        }
    }
    SECTION("TASK_WEIGHT_REPLY") {
        for (std::uint32_t st : {PVGPU_OK, PVGPU_E_INVALID, PVGPU_E_LIMIT, PVGPU_E_INTERNAL})
            CHECK_FALSE(check(PVGPU_MSG_TASK_WEIGHT_REPLY, pvgpu_status_reply{st, 0}));
        CHECK_THAT(*check(PVGPU_MSG_TASK_WEIGHT_REPLY, pvgpu_status_reply{7, 0}),
                   Catch::Contains("TASK_WEIGHT_REPLY (seq 1): status 7 is unknown"));
        CHECK_THAT(*check(PVGPU_MSG_TASK_WEIGHT_REPLY, pvgpu_status_reply{PVGPU_OK, 3}),
                   Catch::Contains("chan_id is not zero"));
        CHECK_THAT(*validate(header(PVGPU_MSG_TASK_WEIGHT_REPLY, 16), Bytes(16), 0),
                   Catch::Contains("len 16, expected 8"));
        CHECK_THAT(*check(PVGPU_MSG_TASK_WEIGHT_REPLY, pvgpu_status_reply{PVGPU_OK, 0}, 2),
                   Catch::Contains("only CHAN_REPLY"));
    }
    SECTION("CHAN_FREE") {
        CHECK_THAT(*check(PVGPU_MSG_CHAN_FREE, pvgpu_chan_ref{1, 2}), Catch::Contains("reserved field is not zero"));
    }
    SECTION("modes in range") {
        auto m = mode_body();
        m.mode = 3;
        CHECK_THAT(*check(PVGPU_MSG_MODE, m), Catch::Contains("MODE (seq 1): mode 3 is out of range"));
        m = mode_body();
        m.reserved = 5;
        CHECK_THAT(*check(PVGPU_MSG_MODE, m), Catch::Contains("reserved field is not zero"));
        auto a = mode_ack_body();
        a.mode = 99;
        CHECK_THAT(*check(PVGPU_MSG_MODE_ACK, a), Catch::Contains("mode 99 is out of range"));
        auto c = chan_reply_ok();
        c.mode = 3;
        CHECK_THAT(*check(PVGPU_MSG_CHAN_REPLY, c, 2), Catch::Contains("mode 3 is out of range"));
    }
    SECTION("statuses known") {
        auto hr = hello_reply_body();
        hr.status = 7;
        CHECK_THAT(*check(PVGPU_MSG_HELLO_REPLY, hr), Catch::Contains("status 7 is unknown"));
        hr = hello_reply_body();
        hr.version = 0;
        CHECK_THAT(*check(PVGPU_MSG_HELLO_REPLY, hr), Catch::Contains("version 0 is invalid"));
        hr.status = PVGPU_E_VERSION;  // a refusal need not name a version
        CHECK_FALSE(check(PVGPU_MSG_HELLO_REPLY, hr));
        auto c = chan_reply_err();
        c.status = 100;
        CHECK_THAT(*check(PVGPU_MSG_CHAN_REPLY, c), Catch::Contains("status 100 is unknown"));
        CHECK_THAT(*check(PVGPU_MSG_FREE_REPLY, pvgpu_status_reply{9, 1}), Catch::Contains("status 9 is unknown"));
        auto e = error_body();
        e.status = 8;
        CHECK_THAT(*check(PVGPU_MSG_ERROR, e), Catch::Contains("ERROR (seq 1): status 8 is unknown"));
    }
    SECTION("CHAN_REPLY mem_size") {
        auto c = chan_reply_ok();
        c.mem_size = 4096;
        CHECK_THAT(*check(PVGPU_MSG_CHAN_REPLY, c, 2),
                   Catch::Contains("mem_size 4096 is not PVGPU_CHAN_MEM_SIZE"));
    }
    SECTION("NOTICE kind") {
        for (std::uint32_t k : {0u, 4u}) {
            auto n = notice_body();
            n.kind = k;
            CHECK_THAT(*check(PVGPU_MSG_NOTICE, n), Catch::Contains("notice kind " + std::to_string(k) + " is unknown"));
        }
        for (std::uint32_t k : {PVGPU_NOTICE_WATCHDOG, PVGPU_NOTICE_BAD_ENTRY, PVGPU_NOTICE_DEGRADED}) {
            auto n = notice_body();
            n.kind = k;
            CHECK_FALSE(check(PVGPU_MSG_NOTICE, n));
        }
    }
    SECTION("ERROR") {
        auto e = error_body();
        std::memset(e.message, 'e', sizeof e.message);
        CHECK_THAT(*check(PVGPU_MSG_ERROR, e), Catch::Contains("message is not NUL-terminated"));
        e = error_body();
        e.reserved = 1;
        CHECK_THAT(*check(PVGPU_MSG_ERROR, e), Catch::Contains("reserved field is not zero"));
    }
    SECTION("the reader reports payload errors too") {
        auto h = hello_body();
        h.role = 9;
        CHECK_THAT(reader_error(encode(PVGPU_MSG_HELLO, 5, h)), Catch::Contains("HELLO (seq 5): role 9"));
    }
}

TEST_CASE("wire: oversize len is rejected as soon as the header is complete", "[wire]") {
    const Bytes hdr = body(header(PVGPU_MSG_HELLO, 0x7fffffff));
    Reader r;
    r.feed(std::span<const std::byte>(hdr).first(15));
    CHECK(std::holds_alternative<std::monostate>(r.next()));
    r.feed(std::span<const std::byte>(hdr).subspan(15));
    // Nothing of the announced payload is needed to reject it.
    auto v = r.next();
    REQUIRE(std::holds_alternative<DecodeError>(v));
    CHECK_THAT(std::get<DecodeError>(v).reason, Catch::Contains("len 2147483647 exceeds the maximum payload 1024"));
    CHECK(r.buffered() == 0);

    SECTION("bytes behind a bad header are never kept") {
        Reader r2;
        Bytes s = encode(PVGPU_MSG_PING, 1);
        append(s, hdr);
        s.resize(s.size() + 100000);
        r2.feed(s);
        // The good PING before it is still delivered, then the error.
        CHECK(r2.buffered() == 32);
        r2.feed(Bytes(100000));
        CHECK(r2.buffered() == 32);
        Drained d;
        drain(r2, d);
        REQUIRE(d.messages.size() == 1);
        CHECK(d.messages[0].hdr.type == PVGPU_MSG_PING);
        REQUIRE(d.error);
        CHECK_THAT(*d.error, Catch::Contains("exceeds"));
        CHECK(r2.buffered() == 0);
    }
}

TEST_CASE("wire: errors are sticky", "[wire]") {
    Reader r;
    r.feed(body(header(42, 0)));
    auto v1 = r.next();
    REQUIRE(std::holds_alternative<DecodeError>(v1));
    const std::string reason = std::get<DecodeError>(v1).reason;
    auto fd = make_eventfd();
    const int raw = fd.get();
    std::vector<UniqueFd> fds;
    fds.push_back(std::move(fd));
    r.feed(encode(PVGPU_MSG_PING, 2), std::move(fds));
    CHECK(fd_closed(raw));  // fds fed into a dead stream are closed
    for (int i = 0; i < 3; ++i) {
        auto v = r.next();
        REQUIRE(std::holds_alternative<DecodeError>(v));
        CHECK(std::get<DecodeError>(v).reason == reason);
    }
    CHECK(r.at_eof());
}

TEST_CASE("wire: fd attribution in the reader", "[wire][fds]") {
    SECTION("fds with a chunk in which no message starts") {
        const Bytes hello = encode(PVGPU_MSG_HELLO, 1, hello_body());
        Reader r;
        r.feed(std::span<const std::byte>(hello).first(20));
        auto fd = make_eventfd();
        const int raw = fd.get();
        std::vector<UniqueFd> fds;
        fds.push_back(std::move(fd));
        r.feed(std::span<const std::byte>(hello).subspan(20), std::move(fds));
        CHECK(fd_closed(raw));
        auto v = r.next();
        REQUIRE(std::holds_alternative<DecodeError>(v));
        CHECK_THAT(std::get<DecodeError>(v).reason, Catch::Contains("no message starting in their chunk"));
    }
    SECTION("more than the maximum at once") {
        std::vector<UniqueFd> fds = two_fds();
        fds.push_back(make_eventfd());
        fds.push_back(make_eventfd());
        Reader r;
        r.feed(encode(PVGPU_MSG_CHAN_REPLY, 1, chan_reply_ok()), std::move(fds));
        auto v = r.next();
        REQUIRE(std::holds_alternative<DecodeError>(v));
        CHECK_THAT(std::get<DecodeError>(v).reason, Catch::Contains("4 fds arrived at once"));
    }
    SECTION("fds go to the last message starting in the chunk") {
        // What the kernel does when an fd-less tail is glued in front.
        Bytes s = encode(PVGPU_MSG_MODE, 0, mode_body());
        append(s, encode(PVGPU_MSG_CHAN_REPLY, 4, chan_reply_ok()));
        Reader r;
        r.feed(s, two_fds());
        Drained d;
        drain(r, d);
        REQUIRE_FALSE(d.error);
        REQUIRE(d.messages.size() == 2);
        CHECK(d.messages[0].fds.empty());
        CHECK(d.messages[1].fds.size() == 2);
    }
    SECTION("fds on a wrong message type") {
        Reader r;
        std::vector<UniqueFd> fds;
        fds.push_back(make_eventfd());
        r.feed(encode(PVGPU_MSG_CHAN_ALLOC, 3, alloc_body()), std::move(fds));
        auto v = r.next();
        REQUIRE(std::holds_alternative<DecodeError>(v));
        CHECK_THAT(std::get<DecodeError>(v).reason, Catch::Contains("CHAN_ALLOC (seq 3): carries 1 fds"));
    }
}

TEST_CASE("wire: fds over a real socket are received and owned", "[wire][fds]") {
    SocketPair sp;
    auto memfd = make_memfd(PVGPU_CHAN_MEM_SIZE);
    auto efd = make_eventfd();
    const int sent[2] = {memfd.get(), efd.get()};

    // A fd-less message first, sent separately: the receiver may get both
    // in one recvmsg() and must still give the fds to the CHAN_REPLY.
    const Bytes mode = encode(PVGPU_MSG_MODE, 0, mode_body());
    const Bytes reply = encode(PVGPU_MSG_CHAN_REPLY, 11, chan_reply_ok());
    REQUIRE(send_some(sp.a.get(), mode, {}) == mode.size());
    REQUIRE(send_some(sp.a.get(), reply, sent) == reply.size());

    Reader r;
    Drained d;
    for (int i = 0; i < 10 && d.messages.size() < 2 && !d.error; ++i) {
        REQUIRE(receive(sp.b.get(), r));
        drain(r, d);
    }
    REQUIRE_FALSE(d.error);
    REQUIRE(d.messages.size() == 2);
    CHECK(d.messages[0].hdr.type == PVGPU_MSG_MODE);
    CHECK(d.messages[0].fds.empty());

    int got[2];
    {
        Message m = std::move(d.messages[1]);
        d.messages.clear();
        REQUIRE(m.hdr.type == PVGPU_MSG_CHAN_REPLY);
        REQUIRE(m.fds.size() == 2);
        got[0] = m.fds[0].get();
        got[1] = m.fds[1].get();
        CHECK(fd_open(got[0]));
        CHECK(fd_open(got[1]));
        CHECK(got[0] != sent[0]);
        CHECK(got[1] != sent[1]);
        // MSG_CMSG_CLOEXEC
        CHECK((::fcntl(got[0], F_GETFD) & FD_CLOEXEC) != 0);
        CHECK((::fcntl(got[1], F_GETFD) & FD_CLOEXEC) != 0);
        // Same objects: the memfd's size, and the doorbell rings across.
        struct stat st{};
        REQUIRE(::fstat(got[0], &st) == 0);
        CHECK(st.st_size == PVGPU_CHAN_MEM_SIZE);
        const std::uint64_t one = 1;
        REQUIRE(::write(got[1], &one, sizeof one) == sizeof one);
        std::uint64_t val = 0;
        REQUIRE(::read(efd.get(), &val, sizeof val) == sizeof val);
        CHECK(val == 1);
    }
    // The Message owned them: gone with it.
    CHECK(fd_closed(got[0]));
    CHECK(fd_closed(got[1]));
    CHECK(fd_open(sent[0]));
}

TEST_CASE("wire: the Writer sends fds with the right message", "[wire][fds]") {
    SocketPair sp;
    Writer w;
    w.push(encode(PVGPU_MSG_PONG, 1));
    w.push(encode(PVGPU_MSG_CHAN_REPLY, 2, chan_reply_ok()), two_fds());
    w.push(encode(PVGPU_MSG_MODE, 0, mode_body()));
    CHECK(w.pending_bytes() == 16 + 32 + 32);
    const int before = count_open_fds();
    REQUIRE(w.flush(sp.a.get()));
    CHECK(w.empty());
    CHECK(count_open_fds() == before - 2);  // the queue closed its copies

    Reader r;
    Drained d;
    for (int i = 0; i < 10 && d.messages.size() < 3; ++i) {
        REQUIRE(receive(sp.b.get(), r));
        drain(r, d);
    }
    REQUIRE_FALSE(d.error);
    REQUIRE(d.messages.size() == 3);
    CHECK(d.messages[0].fds.empty());
    CHECK(d.messages[1].fds.size() == 2);
    CHECK(d.messages[2].fds.empty());
}

TEST_CASE("wire: the Writer completes partial writes", "[wire]") {
    SocketPair sp;
    int small = 4096;
    REQUIRE(::setsockopt(sp.a.get(), SOL_SOCKET, SO_SNDBUF, &small, sizeof small) == 0);
    Writer w;
    std::uint32_t pushed = 0;
    for (; pushed < 2000; ++pushed) w.push(encode(PVGPU_MSG_HELLO, pushed, hello_body()));
    Reader r;
    Drained d;
    for (int i = 0; i < 100000 && (d.messages.size() < pushed) && !d.error; ++i) {
        w.flush(sp.a.get());
        REQUIRE(receive(sp.b.get(), r));
        drain(r, d);
    }
    REQUIRE_FALSE(d.error);
    REQUIRE(d.messages.size() == pushed);
    for (std::uint32_t i = 0; i < pushed; ++i) CHECK(d.messages[i].hdr.seq == i);
    CHECK(w.empty());
}

TEST_CASE("wire: fds on a wrong message type over a socket are rejected and closed", "[wire][fds]") {
    SocketPair sp;
    auto efd = make_eventfd();
    const int sent[1] = {efd.get()};
    const Bytes hello = encode(PVGPU_MSG_HELLO, 1, hello_body());
    const int before = count_open_fds();
    REQUIRE(send_some(sp.a.get(), hello, sent) == hello.size());
    Reader r;
    REQUIRE(receive(sp.b.get(), r));
    auto v = r.next();
    REQUIRE(std::holds_alternative<DecodeError>(v));
    CHECK_THAT(std::get<DecodeError>(v).reason, Catch::Contains("HELLO (seq 1): carries 1 fds"));
    CHECK(count_open_fds() == before);  // the received copy is closed
}

TEST_CASE("wire: more fds than the cmsg buffer holds are an error", "[wire][fds]") {
    SocketPair sp;
    auto f1 = make_eventfd();
    auto f2 = make_eventfd();
    auto f3 = make_eventfd();
    auto f4 = make_eventfd();
    auto f5 = make_eventfd();
    const Bytes reply = encode(PVGPU_MSG_CHAN_REPLY, 1, chan_reply_ok());
    // send_some refuses to send more than the maximum itself.
    const int four[4] = {f1.get(), f2.get(), f3.get(), f4.get()};
    CHECK_THROWS_AS(send_some(sp.a.get(), reply, four), std::invalid_argument);

    // A raw sendmsg with 5 fds arrives truncated (MSG_CTRUNC).  (4 would
    // still fit: the buffer for 3 is padded to 8-byte alignment, and the
    // reader refuses them as "4 fds arrived at once".)
    const int five[5] = {f1.get(), f2.get(), f3.get(), f4.get(), f5.get()};
    iovec iov{const_cast<std::byte*>(reply.data()), reply.size()};
    alignas(cmsghdr) char ctl[CMSG_SPACE(5 * sizeof(int))] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ctl;
    msg.msg_controllen = sizeof ctl;
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(5 * sizeof(int));
    std::memcpy(CMSG_DATA(c), five, sizeof five);
    const int before = count_open_fds();
    REQUIRE(::sendmsg(sp.a.get(), &msg, MSG_NOSIGNAL) == static_cast<ssize_t>(reply.size()));
    Reader r;
    REQUIRE(receive(sp.b.get(), r));
    auto v = r.next();
    REQUIRE(std::holds_alternative<DecodeError>(v));
    CHECK_THAT(std::get<DecodeError>(v).reason, Catch::Contains("fds truncated"));
    CHECK(count_open_fds() == before);
}

TEST_CASE("wire: EOF", "[wire]") {
    SECTION("mid-message") {
        SocketPair sp;
        const Bytes hello = encode(PVGPU_MSG_HELLO, 1, hello_body());
        REQUIRE(send_some(sp.a.get(), std::span<const std::byte>(hello).first(50), {}) == 50);
        sp.a.reset();
        Reader r;
        REQUIRE(receive(sp.b.get(), r));
        CHECK(std::holds_alternative<std::monostate>(r.next()));
        CHECK_FALSE(receive(sp.b.get(), r));
        auto e = r.at_eof();
        REQUIRE(e);
        CHECK_THAT(e->reason, Catch::Contains("connection closed mid-message (50 bytes"));
    }
    SECTION("between messages") {
        SocketPair sp;
        const Bytes ping = encode(PVGPU_MSG_PING, 1);
        REQUIRE(send_some(sp.a.get(), ping, {}) == ping.size());
        sp.a.reset();
        Reader r;
        REQUIRE(receive(sp.b.get(), r));
        CHECK(std::holds_alternative<Message>(r.next()));
        CHECK_FALSE(receive(sp.b.get(), r));
        CHECK_FALSE(r.at_eof());
    }
    SECTION("nothing to read is not EOF") {
        SocketPair sp;
        Reader r;
        CHECK(receive(sp.b.get(), r));
        CHECK(r.buffered() == 0);
    }
    SECTION("send to a closed peer throws") {
        SocketPair sp;
        sp.b.reset();
        const Bytes ping = encode(PVGPU_MSG_PING, 1);
        CHECK_THROWS_AS(send_some(sp.a.get(), ping, {}), std::system_error);
    }
}

TEST_CASE("wire: garbage never crashes the reader", "[wire][garbage]") {
    std::mt19937 rng(20240611);  // fixed: the same streams on every run
    const auto samples = all_samples();
    int messages = 0, errors = 0;
    for (int iter = 0; iter < 3000; ++iter) {
        // Valid messages, some mutated, interleaved with random bytes.
        Bytes stream;
        const int parts = 1 + static_cast<int>(rng() % 6);
        for (int p = 0; p < parts; ++p) {
            const auto& s = samples[rng() % samples.size()];
            Bytes m = encode(s.type, rng(), s.payload);
            switch (rng() % 4) {
            case 0:  // flip a byte
                m[rng() % m.size()] = static_cast<std::byte>(rng());
                break;
            case 1: {  // random bytes
                Bytes junk(rng() % 64);
                for (auto& b : junk) b = static_cast<std::byte>(rng());
                append(stream, junk);
                break;
            }
            default: break;
            }
            append(stream, m);
        }
        Reader r;
        Drained d;
        std::size_t off = 0;
        while (off < stream.size()) {
            const std::size_t n = std::min<std::size_t>(1 + rng() % 40, stream.size() - off);
            std::vector<UniqueFd> fds;
            if (rng() % 8 == 0) fds = two_fds();
            r.feed(std::span<const std::byte>(stream).subspan(off, n), std::move(fds));
            off += n;
            drain(r, d);
            CHECK(r.buffered() <= 40 + sizeof(pvgpu_msg_hdr) + PVGPU_PROTO_MAX_PAYLOAD);
            if (d.error) break;
        }
        for (const auto& m : d.messages) {
            REQUIRE_FALSE(validate(m.hdr, m.payload, m.fds.size()));
            for (const auto& fd : m.fds) REQUIRE(fd_open(fd.get()));
        }
        messages += static_cast<int>(d.messages.size());
        if (d.error) {
            ++errors;
            CHECK_FALSE(d.error->empty());
            auto v = r.next();
            REQUIRE(std::holds_alternative<DecodeError>(v));
            CHECK(std::get<DecodeError>(v).reason == *d.error);
        }
    }
    // Both outcomes occur, so the test exercises both paths.
    CHECK(messages > 1000);
    CHECK(errors > 1000);
}

TEST_CASE("wire: names", "[wire]") {
    char f[8];
    set_name(f, sizeof f, "abc");
    CHECK(name_of(f, sizeof f) == "abc");
    CHECK(f[3] == 0);
    CHECK(f[7] == 0);
    set_name(f, sizeof f, "0123456789");
    CHECK(name_of(f, sizeof f) == "0123456");  // truncated, still NUL-terminated
    set_name(f, sizeof f, std::string("a\nb\xff", 4));
    CHECK(name_of(f, sizeof f) == "a?b?");
    const char full[4] = {'a', 'b', 'c', 'd'};
    CHECK(name_of(full, sizeof full) == "abcd");  // never reads past the field

    CHECK(std::string(type_name(PVGPU_MSG_HELLO)) == "HELLO");
    CHECK(std::string(type_name(PVGPU_MSG_CHAN_REPLY)) == "CHAN_REPLY");
    CHECK(std::string(type_name(PVGPU_MSG_PONG)) == "PONG");
    CHECK(std::string(type_name(1000)) == "UNKNOWN");
    CHECK(payload_size(PVGPU_MSG_HELLO) == sizeof(pvgpu_hello));
    CHECK(payload_size(PVGPU_MSG_PING) == 0u);
    CHECK_FALSE(payload_size(99));
}
