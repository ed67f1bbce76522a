// libFuzzer target for pvgpud's state machine: a real Daemon (embedded
// simulated GPU) on real UNIX sockets, driven by up to four clients whose
// messages, descriptors and channel stores come from the input, plus admin
// requests.  Every input builds a fresh daemon, so a crash reproduces from
// its input alone.
//
// Input: a sequence of operations, one byte each (low 4 bits the operation,
// high 4 bits the client), followed by the bytes that operation consumes:
//   connect, HELLO (role, version, one of two UUIDs, name), CHAN_ALLOC (pid
//   hint, task name), CHAN_FREE, MODE_ACK, TRAP_REPORT, TASK_WEIGHT, PING,
//   raw bytes (optionally with a memfd, an eventfd or a pipe attached),
//   read replies (keeping CHAN_REPLY fds), store ring entries and IB_PUT in
//   a channel and ring its doorbell, an admin request line, close a client,
//   run the loop for a while.
// Checks: nothing crashes, leaks or trips a sanitizer; everything the daemon
// sends is a valid message and never an internal error; once every client
// is gone the daemon reports no clients and no channels (admin "stats"),
// and destroying it closes every descriptor it opened.
#include <fcntl.h>
#include <glib.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "daemon/daemon.hpp"
#include "daemon/log.hpp"
#include "proto/wire.hpp"

using namespace pvgpu;
using namespace pvgpu::daemon;

namespace {

void require(bool ok, const char* what) {
    if (!ok) {
        std::fprintf(stderr, "fuzz_daemon: check failed: %s\n", what);
        std::abort();
    }
}

class Input {
public:
    Input(const std::uint8_t* data, std::size_t size) : p_(data), left_(size) {}
    bool empty() const { return left_ == 0; }
    std::uint8_t byte() {
        if (left_ == 0) return 0;
        --left_;
        return *p_++;
    }
    std::uint32_t u32() {
        std::uint32_t v = 0;
        for (int i = 0; i < 4; ++i) v |= std::uint32_t{byte()} << (8 * i);
        return v;
    }
    std::string text(std::size_t max) {
        std::string s(std::min<std::size_t>(byte() % (max + 1), left_), '\0');
        for (char& c : s) c = static_cast<char>(byte());
        return s;
    }

private:
    const std::uint8_t* p_;
    std::size_t left_;
};

// Descriptors of the kinds pvgpud opens (sockets, memfds, eventfds,
// timerfds, files).  Pipes are left out: libFuzzer talks to llvm-symbolizer
// through pipes it keeps once it has printed a new function, so pvgpud's
// completion notifiers (pipes) are not counted.
int open_fds() {
    int n = 0;
    for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
        std::error_code ec;
        n += std::filesystem::read_symlink(e.path(), ec).string().rfind("pipe:", 0) == 0 ? 0 : 1;
    }
    return n;
}

UniqueFd connect_to(const std::string& path) {
    UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    require(bool(fd), "socket");
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
    require(connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0, "connect");
    return fd;
}

struct Channel {
    std::uint32_t id = 0;
    UniqueFd mem, bell, notifier;  // notifier: version-3 host sessions only
    void* map = nullptr;
    std::uint32_t put = 0;
    ~Channel() {
        if (map) munmap(map, PVGPU_CHAN_MEM_SIZE);
    }
};

struct Client {
    UniqueFd sock;
    wire::Reader reader;
    std::uint32_t seq = 0;
    std::vector<std::unique_ptr<Channel>> channels;
};

class Harness {
public:
    explicit Harness(const std::string& dir) : dir_(dir) {
        std::filesystem::remove_all(dir_ + "/state");
        Config cfg;
        cfg.socket = dir_ + "/client.sock";
        cfg.admin_socket = dir_ + "/admin.sock";
        cfg.state_dir = dir_ + "/state";
        cfg.admin_group = "";
        cfg.log_level = LogLevel::Error;
        // Small limits, so inputs reach them.
        cfg.limits.max_clients = 3;
        cfg.limits.max_channels_per_client = 3;
        cfg.limits.max_channels = 6;
        cfg.limits.vmm_channels_per_uid = 5;
        cfg.limits.host_clients_per_uid = 3;
        cfg.limits.host_channels_per_uid = 4;
        cfg.limits.max_queue_fds = 4;
        cfg.limits.max_queue_bytes = 16 * 1024;
        // Two GPUs: placement, a HELLO naming either (or a third, refused)
        // and VMs with a device on each are reached too.
        cfg.gpus.assign(2, GpuConfig{});
        for (std::uint32_t i = 0; i < 2; ++i) {
            cfg.gpus[i].name = "gpu" + std::to_string(i);
            cfg.gpus[i].watchdog_ms = 5;
        }
        daemon_ = std::make_unique<Daemon>(std::move(cfg));
    }

    void pump(int rounds = 64) {
        for (int i = 0; i < rounds && g_main_context_iteration(daemon_->context(), FALSE); ++i) {
        }
    }

    void run(Input& in) {
        for (int ops = 0; ops < 200 && !in.empty(); ++ops) {
            const std::uint8_t op = in.byte();
            Client* c = client(op >> 4);
            switch (op & 0x0f) {
            case 0:
                if (clients_.size() < 4) {
                    clients_.push_back(std::make_unique<Client>());
                    clients_.back()->sock = connect_to(dir_ + "/client.sock");
                }
                break;
            case 1: if (c) hello(*c, in); break;
            case 2:
                if (c) {
                    pvgpu_chan_alloc a{};
                    a.pid_hint = in.byte() % 4;
                    wire::set_name(a.task_name, sizeof a.task_name, in.text(8));
                    send(*c, PVGPU_MSG_CHAN_ALLOC, a);
                }
                break;
            case 3:
                if (c) {
                    pvgpu_chan_ref r{};
                    r.chan_id = chan_id(*c, in.byte());
                    send(*c, PVGPU_MSG_CHAN_FREE, r);
                }
                break;
            case 4:
                if (c) {
                    pvgpu_mode_ack a{};
                    a.chan_id = chan_id(*c, in.byte());
                    a.mode = in.byte() % 3;
                    a.mode_seq = in.byte();
                    a.guest_put = in.byte();
                    send(*c, PVGPU_MSG_MODE_ACK, a);
                }
                break;
            case 5:
                if (c) {
                    pvgpu_trap_report t{};
                    t.chan_id = chan_id(*c, in.byte());
                    t.put = in.byte();
                    send(*c, PVGPU_MSG_TRAP_REPORT, t);
                }
                break;
            case 6:
                if (c) {
                    pvgpu_task_weight t{};
                    t.pid_hint = in.byte() % 4;
                    t.weight = in.byte() * 50u;
                    send(*c, PVGPU_MSG_TASK_WEIGHT, t);
                }
                break;
            case 7: if (c) send_bytes(*c, wire::encode(PVGPU_MSG_PING, ++c->seq), {}); break;
            case 8: if (c) raw(*c, in); break;
            case 9: if (c) read_replies(*c); break;
            case 10: if (c) submit(*c, in); break;
            case 11: admin(in); break;
            case 12:
                if (c) {
                    clients_.erase(clients_.begin() + (op >> 4) % clients_.size());
                    pump();
                }
                break;
            default: pump(in.byte()); break;
            }
            pump(8);
        }
    }

    // Every client gone: nothing may be left behind.
    void finish() {
        clients_.clear();
        pump(256);
        const nlohmann::json stats = admin_request(R"({"cmd":"stats"})");
        require(stats.value("clients", -1) == 0, "clients left after every client closed");
        require(stats.value("channels", -1) == 0, "channels left after every client closed");
        daemon_.reset();
    }

private:
    Client* client(unsigned k) { return clients_.empty() ? nullptr : clients_[k % clients_.size()].get(); }

    std::uint32_t chan_id(Client& c, std::uint8_t b) {
        // Mostly channels the client owns, sometimes anything.
        if (!c.channels.empty() && b < 192) return c.channels[b % c.channels.size()]->id;
        return b % 8;
    }

    void hello(Client& c, Input& in) {
        // Mostly valid (a session must get past HELLO for the rest to be
        // reached), sometimes version 0, role 3 or no UUID.
        pvgpu_hello h{};
        const std::uint8_t b = in.byte();
        static constexpr std::array<std::uint32_t, 4> kVersion{PVGPU_PROTO_VERSION, 1, PVGPU_PROTO_VERSION, 0};
        static constexpr std::array<std::uint32_t, 4> kRole{PVGPU_ROLE_VMM, PVGPU_ROLE_HOST, PVGPU_ROLE_VMM, 3};
        static constexpr std::array<std::uint8_t, 2> kUuidByte{0x11, 0x22};
        h.version = kVersion[b % 4];
        h.role = kRole[(b >> 2) % 4];
        if (!(b & 0x40)) std::memset(h.uuid, kUuidByte[(b >> 7) & 1], sizeof h.uuid);
        wire::set_name(h.name, sizeof h.name, in.text(8));
        h.pid = in.byte();
        h.gpu = in.byte() % 4;  // any, GPU 0, GPU 1, or a GPU the host lacks
        send(c, PVGPU_MSG_HELLO, h);
    }

    template <class T>
    void send(Client& c, std::uint16_t type, const T& body) {
        send_bytes(c, wire::encode(type, ++c.seq, body), {});
    }

    void send_bytes(Client& c, const std::vector<std::byte>& bytes, std::span<const int> fds) {
        std::size_t off = 0;
        for (int tries = 0; off < bytes.size() && tries < 16; ++tries) {
            try {
                off += wire::send_some(c.sock.get(), std::span(bytes).subspan(off), off == 0 ? fds : std::span<const int>{});
            } catch (const std::system_error&) {
                return;  // the daemon closed it
            }
            if (off < bytes.size()) {
                read_replies(c);  // the daemon may wait for us to read
                pump();
            }
        }
    }

    void raw(Client& c, Input& in) {
        const std::uint8_t how = in.byte();
        std::vector<std::byte> bytes(how % 48);
        for (auto& b : bytes) b = std::byte{in.byte()};
        UniqueFd fd;
        if (how & 0x40) fd = UniqueFd(memfd_create("fuzz", MFD_CLOEXEC));
        if (how & 0x80) fd = UniqueFd(eventfd(0, EFD_CLOEXEC));
        const int fds[1] = {fd.get()};
        if (!bytes.empty()) send_bytes(c, bytes, fd ? std::span<const int>(fds) : std::span<const int>{});
    }

    void read_replies(Client& c) {
        pump();
        bool alive = true;
        for (int i = 0; i < 8 && alive; ++i) {
            try {
                alive = wire::receive(c.sock.get(), c.reader);
            } catch (const std::system_error&) {
                alive = false;
            }
            for (;;) {
                auto r = c.reader.next();
                if (std::holds_alternative<std::monostate>(r)) break;
                require(!std::holds_alternative<wire::DecodeError>(r), "the daemon sent a malformed message");
                auto& m = std::get<wire::Message>(r);
                require(!wire::validate(m.hdr, m.payload, m.fds.size()), "the daemon sent an invalid message");
                // An exception escaped a handler (daemon.cpp answers E_INTERNAL).
                if (m.hdr.type == PVGPU_MSG_ERROR)
                    require(m.as<pvgpu_error>().status != PVGPU_E_INTERNAL, "the daemon failed internally");
                if (m.hdr.type == PVGPU_MSG_CHAN_REPLY && m.fds.size() >= 2 && c.channels.size() < 4) {
                    auto ch = std::make_unique<Channel>();
                    ch->id = m.as<pvgpu_chan_reply>().chan_id;
                    ch->mem = std::move(m.fds[0]);
                    ch->bell = std::move(m.fds[1]);
                    // Kept unread: a client that never reads its notifier.
                    if (m.fds.size() == 3) ch->notifier = std::move(m.fds[2]);
                    void* p = mmap(nullptr, PVGPU_CHAN_MEM_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, ch->mem.get(), 0);
                    ch->map = p == MAP_FAILED ? nullptr : p;
                    c.channels.push_back(std::move(ch));
                }
            }
        }
    }

    void submit(Client& c, Input& in) {
        if (c.channels.empty()) return;
        Channel& ch = *c.channels[in.byte() % c.channels.size()];
        if (!ch.map) return;
        auto* ctrl = static_cast<pvgpu_ctrl_page*>(ch.map);
        auto* ring = reinterpret_cast<pvgpu_ring*>(static_cast<char*>(ch.map) + PVGPU_CHAN_RING_OFFSET);
        const std::uint8_t b = in.byte();
        const unsigned n = b % 5;
        for (unsigned i = 0; i < n; ++i) {
            // Kernels of 0..1.5 ms, sometimes a bad entry or a watchdog victim.
            std::uint64_t ns = std::uint64_t{in.byte()} * 6'000;
            std::uint32_t flags = (b & 0x80) ? in.byte() : PVGPU_ENTRY_IRQ;
            if (b & 0x40) ns = 20 * kMillisecond;
            ring->entries[(ch.put + i) % PVGPU_RING_ENTRIES] = {ns, ch.put + i + 1, flags};
        }
        ch.put += (b & 0x20) ? in.byte() : n;  // sometimes a put the ring does not back
        ctrl->ib_put = ch.put;
        const std::uint64_t one = 1;
        (void)!::write(ch.bell.get(), &one, sizeof one);
    }

    void admin(Input& in) {
        static const char* const kLines[] = {
            R"({"cmd":"list"})", R"({"cmd":"stats"})", R"({"cmd":"set-weight","target":"host/root","weight":300})",
            R"({"cmd":"set-weight","target":"11111111-1111-1111-1111-111111111111","weight":50})",
            R"({"cmd":"set-policy","policy":"dfq"})", R"({"cmd":"set-policy","policy":"hfq"})",
            R"({"cmd":"set-weight","target":"host/root/x","weight":7})", R"({"cmd":"get-policy"})",
            R"({"cmd":"move","target":"11111111-1111-1111-1111-111111111111","gpu":1})",
            R"({"cmd":"move","target":"11111111-1111-1111-1111-111111111111","gpu":0})",
            R"({"cmd":"move","target":"22222222-2222-2222-2222-222222222222","gpu":1,"from":0})",
            R"({"cmd":"set-policy","policy":"timeslice","gpu":1})",
        };
        const std::uint8_t b = in.byte();
        std::string line = (b & 0x80) ? in.text(24) : kLines[b % std::size(kLines)];
        if (line.find('\n') != std::string::npos) line.erase(line.find('\n'));
        (void)admin_request(line);
    }

    // One admin request, answered while the loop runs; null on no answer.
    nlohmann::json admin_request(const std::string& line) {
        UniqueFd s = connect_to(dir_ + "/admin.sock");
        const std::string req = line + "\n";
        require(::send(s.get(), req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size()),
                "admin send");
        std::string got;
        for (int i = 0; i < 1000 && got.find('\n') == std::string::npos; ++i) {
            pump(4);
            char buf[65536];
            ssize_t n = ::recv(s.get(), buf, sizeof buf, 0);
            if (n > 0) got.append(buf, static_cast<std::size_t>(n));
            if (n == 0) break;
        }
        if (got.find('\n') == std::string::npos) return nullptr;
        return nlohmann::json::parse(got.substr(0, got.find('\n')), nullptr, false);
    }

    std::string dir_;
    std::unique_ptr<Daemon> daemon_;
    std::vector<std::unique_ptr<Client>> clients_;
};

// The sockets and state of every run, removed at exit.
struct WorkDir {
    std::string path;
    WorkDir() : path((std::filesystem::temp_directory_path() / "pvgpu-fuzz-daemon-XXXXXX").string()) {
        require(mkdtemp(path.data()) != nullptr, "mkdtemp");
    }
    ~WorkDir() {
        std::error_code ec;
        std::filesystem::remove_all(path, ec);
    }
};

const std::string& work_dir() {
    static const WorkDir dir;
    return dir.path;
}

void run_once(const std::uint8_t* data, std::size_t size) {
    Harness h(work_dir());
    Input in(data, size);
    h.run(in);
    h.finish();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    // GLib and the C library open a few descriptors for good the first time
    // they are used (GLib's worker thread and its wakeup eventfd, signal
    // handling): a run that touches everything once comes first, and from
    // then on every run must give back every descriptor it took.
    static const int baseline = [] {
        set_log_level(LogLevel::Error);
        // connect; HELLO as a host; CHAN_ALLOC; read; submit one entry;
        // admin list; close; run the loop.
        static constexpr std::uint8_t kWarmUp[] = {0x00, 0x01, 0x45, 0x00, 0x00, 0x02, 0x00, 0x00, 0x09,
                                                   0x0a, 0x00, 0x01, 0x01, 0x0b, 0x00, 0x0c, 0x0d, 0x40};
        run_once(kWarmUp, sizeof kWarmUp);
        return open_fds();
    }();
    run_once(data, size);
    if (open_fds() != baseline) {
        for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
            std::error_code ec;
            std::fprintf(stderr, "fd %s -> %s\n", e.path().filename().c_str(),
                         std::filesystem::read_symlink(e.path(), ec).c_str());
        }
        require(false, "descriptors leaked by a daemon run (listed above)");
    }
    return 0;
}
