// The membership store's client (part of the `_collectives` module:
// collectives.cpp): the store of an elastic job, as the runtime's membership
// protocol and its liveness monitor use it (python/src/membership.rs), from
// threads of their own and without the interpreter lock. Keys and values are
// bytes. Also the cancellation of broken membership epochs.

#include "shim.h"

namespace gradsync::shim {

namespace {

std::string key_of(const char* key, size_t key_len) { return std::string(key, key_len); }

// Copies `value` into `out` (capacity `cap`); `*len` is its full length (the
// caller retries with a larger buffer when it exceeds `cap`).
void copy_out(const std::vector<uint8_t>& value, uint8_t* out, size_t cap, size_t* len) {
  *len = value.size();
  if (value.size() <= cap && !value.empty()) {
    std::memcpy(out, value.data(), value.size());
  }
}

}  // namespace

int32_t store_add(void* client, const char* key, size_t key_len, int64_t delta, int64_t* out, char* err,
                  size_t err_len) {
  auto* c = static_cast<StoreClient*>(client);
  return guarded(err, err_len, [&] { *out = c->store->add(key_of(key, key_len), delta); });
}

int32_t store_set(void* client, const char* key, size_t key_len, const uint8_t* value, size_t len, char* err,
                  size_t err_len) {
  auto* c = static_cast<StoreClient*>(client);
  return guarded(err, err_len, [&] { c->store->set(key_of(key, key_len), std::vector<uint8_t>(value, value + len)); });
}

// What a compare-and-set expects to read a missing key by (no protocol value is this).
const std::vector<uint8_t> kAbsent = {0, 'g', 'r', 'a', 'd', 's', 'y', 'n', 'c', '-', 'a', 'b', 's', 'e', 'n', 't', 0};

// `*found` says whether `key` exists; if it does, its value is copied out. Never blocks for a missing key, and
// one round trip: a compare-and-set expecting a value no key holds changes nothing and returns what is there
// (the expected value itself when the key is missing).
int32_t store_get(void* client, const char* key, size_t key_len, int32_t* found, uint8_t* out, size_t cap,
                  size_t* len, char* err, size_t err_len) {
  auto* c = static_cast<StoreClient*>(client);
  *found = 0;
  *len = 0;
  return guarded(err, err_len, [&] {
    auto value = c->store->compareSet(key_of(key, key_len), kAbsent, kAbsent);
    if (value != kAbsent) {
      *found = 1;
      copy_out(value, out, cap, len);
    }
  });
}

// The integers at `count` keys (`keys` holds them one after another, `lens` their lengths) into `out`, in one
// `multiGet`. A key this client has not read before is made to exist first (`add(key, 0)`, which keeps a value
// that is there), so the batched read never waits for a missing key.
int32_t store_counters(void* client, const char* keys, const size_t* lens, size_t count, int64_t* out, char* err,
                       size_t err_len) {
  auto* c = static_cast<StoreClient*>(client);
  return guarded(err, err_len, [&] {
    std::vector<std::string> names;
    names.reserve(count);
    for (size_t i = 0, at = 0; i < count; at += lens[i], ++i) {
      names.emplace_back(keys + at, lens[i]);
    }
    {
      std::lock_guard<std::mutex> lock(c->known_mutex);
      for (const auto& name : names) {
        if (c->known.insert(name).second) {
          c->store->add(name, 0);
        }
      }
    }
    auto values = c->store->multiGet(names);
    for (size_t i = 0; i < count; ++i) {
      std::string text(values[i].begin(), values[i].end());
      try {
        size_t used = 0;
        out[i] = std::stoll(text, &used);
      } catch (const std::exception&) {
        throw std::runtime_error(names[i] + " does not hold an integer");
      }
    }
  });
}

// Appends `value` to the value at `key` (creating it), atomically: a ledger's entries.
int32_t store_append(void* client, const char* key, size_t key_len, const uint8_t* value, size_t len, char* err,
                     size_t err_len) {
  auto* c = static_cast<StoreClient*>(client);
  return guarded(err, err_len,
                 [&] { c->store->append(key_of(key, key_len), std::vector<uint8_t>(value, value + len)); });
}

// Waits until `key` exists, at most `timeout_ms` (`*found` = 0 then): the store answers when the key is set.
int32_t store_wait(void* client, const char* key, size_t key_len, int64_t timeout_ms, int32_t* found, char* err,
                   size_t err_len) {
  auto* c = static_cast<StoreClient*>(client);
  *found = 0;
  return guarded(err, err_len, [&] {
    try {
      c->store->wait({key_of(key, key_len)}, std::chrono::milliseconds(timeout_ms));
      *found = 1;
    } catch (const c10::DistStoreError&) {
      // The wait ran out (a network failure is another error, and is raised).
    }
  });
}

// Sets `key` to `desired` if it holds `expected` (or is absent and `expected`
// is empty); copies out the value it holds afterwards (the winner's).
int32_t store_compare_set(void* client, const char* key, size_t key_len, const uint8_t* expected, size_t expected_len,
                          const uint8_t* desired, size_t desired_len, uint8_t* out, size_t cap, size_t* len,
                          char* err, size_t err_len) {
  auto* c = static_cast<StoreClient*>(client);
  return guarded(err, err_len, [&] {
    auto now = c->store->compareSet(key_of(key, key_len), std::vector<uint8_t>(expected, expected + expected_len),
                                    std::vector<uint8_t>(desired, desired + desired_len));
    copy_out(now, out, cap, len);
  });
}

// Every wait of an endpoint of membership epoch <= `epoch` fails from now on.
void cancel_epoch(void* cancel, int64_t epoch) {
  auto* c = static_cast<Cancel*>(cancel);
  int64_t seen = c->broken.load();
  while (seen < epoch && !c->broken.compare_exchange_weak(seen, epoch)) {
  }
}


}  // namespace gradsync::shim
