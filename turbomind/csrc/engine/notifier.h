// Notifier: an eventfd the engine thread signals once per step that put outputs in the outbox,
// so an event loop can wait for outputs beside its sockets (asyncio's loop.add_reader) instead
// of a thread blocking in wait_outputs and waking the loop in turn: one thread wake per step.
//
// The counter only says "look at the outbox": whoever reads outputs clears it first, then takes
// the outbox, so a step that lands in between signals again and is never missed.
#pragma once

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace turbomind {

class Notifier {
public:
    Notifier() : fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
        if (fd_ < 0) throw std::runtime_error("eventfd failed: errno " + std::to_string(errno));
    }
    ~Notifier() { close(fd_); }
    Notifier(const Notifier &) = delete;
    Notifier & operator=(const Notifier &) = delete;

    int fd() const { return fd_; }

    // Any thread. The counter saturates long before it could block: a write never waits.
    void notify() {
        const uint64_t one = 1;
        ssize_t n;
        do n = write(fd_, &one, sizeof one); while (n < 0 && errno == EINTR);
    }

    // Resets the counter; false if it was already clear.
    bool clear() {
        uint64_t count = 0;
        ssize_t n;
        do n = read(fd_, &count, sizeof count); while (n < 0 && errno == EINTR);
        return n == static_cast<ssize_t>(sizeof count);
    }

private:
    int fd_;
};

}  // namespace turbomind
