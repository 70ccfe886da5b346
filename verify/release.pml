/*
 * release.pml: netreap's release protocol, a Promela model for spin.
 * Run verify/check.sh; the README section "What the model proves and what
 * it does not" says what a pass means.
 *
 * Modelled:
 *   - the kernel: network namespaces (netns) are created and die. Each
 *     incarnation gets an inode and an nsid from small pools, so a new
 *     netns can get the inode and the nsid of one that died (reuse). The
 *     only death signal is RTM_DELNSID(nsid) on netreap's one ordered
 *     rtnetlink socket (all-nsid);
 *   - the host-local plugin: ADD under its flock picks a free IP and writes
 *     the file <ip>; DEL under the flock removes the container's files. An
 *     ADD can fail after reserving and before configuring the address (a
 *     chained plugin); DEL can fail (the IP leaks) and may be retried after
 *     the netns is gone; a container can restart with the same ID (podman,
 *     docker) and so get a new netns;
 *   - netreap: its event loop (rtnetlink socket, eBPF ring buffer of CNI
 *     ADD exec/exit), the decision, the journal intents (fsync'd before
 *     acting), the plugin's flock taken once for the group of files a scan
 *     found orphaned, one last look under it for the whole group (the IPs
 *     in no live netns; no CNI run of the container in flight), then per
 *     file: the file is the same, the unlink; the flock released after the
 *     group; a crash after the intent (memory and sockets
 *     lost, state dir kept), restart and recovery (re-verify, never redo);
 *     nsid dumps that can miss any live netns; re-queries of netns it
 *     recorded but does not see.
 *
 * The decision (on netreap's view): ORPHANED only when every netns the
 * container was bound to by an ADD was seen to die (RTM_DELNSID for the nsid
 * it holds for that incarnation, or after a restart the kernel no longer
 * lists the recorded nsid, or lists it for another inode), no CNI run of it
 * is in flight, and the file was written by an ADD netreap saw to its end
 * (the file's mtime is not after that ADD's exit: "bindings dated by the
 * run that made them").
 *
 * Properties (verify/check.sh checks each):
 *   S1  ltl no_dup: no IP is ever configured in two live netns.
 *   S2  assertions at netreap's unlink:
 *       S2a the IP is configured in no live netns;
 *       S2b the netns incarnation whose ADD wrote the file is dead, unless
 *           the file is a re-creation netreap cannot tell from the old one
 *           (A5; S1 and S2a still hold then).
 *   L   ltl released (weak fairness): every reservation whose netns died is
 *       eventually released, if netreap saw the ADD that made it and
 *       recorded the nsid of every netns its container was bound to (the
 *       rest is the orphan-grace path, A4).
 *
 * Bug variants, each must give a counterexample:
 *   -DBUG_DUMP_DEATH    a netns missing from an nsid dump is taken as dead.
 *   -DBUG_NO_LAST_LOOK  no last look: under the flock only the file's owner
 *                       and identity (inode, mtime) are compared.
 *   -DBUG_INODE_DEATH   a recorded death is matched to netns by inode alone.
 *   -DBUG_NEVER_UNLINK  netreap never unlinks (L must fail: not vacuous).
 *   -DLOOK_BEFORE_LOCK  the group's last look is taken before the flock (a
 *                       look shared by a batch without the lock held).
 *   -DNO_S2             leaves out the S2 assertions (to see S1 itself fail).
 * Experiments (not in check.sh, see the README section):
 *   -DNO_FILE_ID_REUSE  the (inode, mtime) check is never fooled (no A5).
 *   -DNO_RUN_DATING     the decision does not ask which run wrote the file.
 *   -DADDR_VIEW         the decision also checks the addresses netreap saw
 *                       (only adds reasons to keep; off by default, A7).
 *
 * Abstractions:
 *   A1 a CNI run's netns (CNI_NETNS) is resolved to its exact incarnation
 *      at exec (the probe reads it there). netreap's own record of a netns
 *      is (nsid, inode): after a restart it can only compare those.
 *   A2 DEL removes the interface before it frees the IP (the bridge plugin
 *      frees the IP first: a plugin-side window, not netreap's).
 *   A3 the last look's reads are exact: the addresses of every live netns,
 *      and (after draining the ring buffer) every CNI run started before.
 *      After a restart, CNI runs in flight are found by a /proc scan.
 *   A4 the orphan-grace path (reservations never seen bound, released
 *      after a time) rests on timing, not on the protocol: not modelled.
 *   A5 a file re-created at once for the same container can have the old
 *      file's inode (reused at once) and mtime (a coarse clock): the
 *      identity check under the flock can be fooled.
 *   A6 time is logical: `tick` advances at every file write; the ring
 *      buffer's records carry it (the exit of an ADD is after its write).
 *   A7 the decision's own address check (on netreap's view) is left out by
 *      default: it only adds reasons to keep, so S1 and S2 carry over; the
 *      last look's exact kernel read is modelled. netreap's view gets no
 *      RTM_DELADDR either.
 *   A8 the runtime creates the netns and execs ADD in one step; the
 *      plugin's critical section, the address-plus-exit and a whole DEL are
 *      single steps (nobody can look inside them).
 *   A9 reading a socket drains it in one step: reading a prefix is the
 *      same as reading all of it when the prefix was all there was.
 *   Bounds: 2 IPs, 2 containers, 3 netns incarnations (container 0
 *   restarted once with the same ID), 2 inode and 2 nsid values, 1 crash.
 */

#define NC     2    /* containers (sandbox IDs) */
#define NIP    2    /* IPs in the host-local range */
#define NG     3    /* netns incarnations in one run */
#define NNSID  2    /* nsid values: the lowest free is taken (reuse) */
#define NONE   255
#define QCAP   16   /* rtnetlink socket queue: never fills in this model */
#define RCAP   6    /* ring buffer: never fills in this model */
#ifndef MAXCRASH
#define MAXCRASH 1
#endif

/* lives of container 0 (restarted once with the same ID) and container 1 */
#ifndef LIVES0
#define LIVES0 2
#endif
#ifndef LIVES1
#define LIVES1 1
#endif

mtype = { NEWNSID, DELNSID, ADDR,        /* rtnetlink (all-nsid socket) */
          ADDX, AEXIT };                 /* eBPF: CNI ADD exec and exit */

/* ======================= the kernel (and ghost truth) ======================= */
bool ns_alive[NG];
bit  ns_ino[NG];       /* two inode values: reuse happens */
byte ns_nsid[NG];
byte ns_ip[NG];        /* the IP configured in the netns, NONE if none */
byte ng_next;          /* the next incarnation */
byte tick;             /* logical time: file writes (A6) */
bool running[NC];      /* a CNI ADD of the container is in flight (A8: a DEL
                          is one step) */
byte run_g[NC];        /* the netns of that ADD, NONE when none */

/* ======================= host-local: <dataDir>/<network>/ =================== */
byte owner[NIP];       /* container + 1 named in the file <ip>; 0: no file */
bit  fid[NIP];         /* the file's inode, as netreap compares it */
byte ftime[NIP];       /* the file's mtime */
bool hl_lock;          /* flock(<dir>/lock) */
byte res_g[NIP];       /* ghost: the netns of the ADD that wrote the file */
byte prev_owner[NIP];  /* ghost: the container of the previous file <ip> */
bool fooled[NIP];      /* ghost: the file looks like its predecessor (A5) */

/* ======================= netreap ======================= */
chan nl = [QCAP] of { mtype, byte, byte, byte };  /* kind, nsid, netns/ip, - */
chan rb = [RCAP] of { mtype, byte, byte, byte };  /* kind, container, netns, time */
bool down;             /* not running: nothing is listening, events are lost */
byte crashes;

/* its memory (lost in a crash) */
byte v_nsid[NNSID];    /* nsid -> incarnation + 1 (0: none known) */
bool v_known[NG];      /* known and alive */
bool v_dead[NG];       /* seen to die: the kernel's word */
byte v_ipg[NG];        /* the address seen in each netns (ADDR_VIEW only) */
byte v_bind[NC];       /* bitmask: the netns each container's ADDs ran in */
bool v_run[NC];        /* ledger: a CNI run of the container in flight */

/* its state dir (fsync'd: survives a crash) */
byte p_nsid[NG];       /* nsid + 1 recorded for an incarnation */
byte p_bind[NC];       /* the bindings */
byte p_lastx[NC];      /* time of the exit of the last ADD of it seen */
bool p_int[NIP];       /* a pending journal intent for the file <ip> */
byte p_owner[NIP];     /* ... for this container */
bit  p_fid[NIP];       /* ... and this file (inode, mtime) */
byte p_ftime[NIP];

/* ======================= properties ======================= */
#define in_live(g, i)  (ns_alive[g] && ns_ip[g] == i)
#define held2(i) ((in_live(0, i) && in_live(1, i)) || (in_live(0, i) && in_live(2, i)) || \
                  (in_live(1, i) && in_live(2, i)))
#define nodup (!held2(0) && !held2(1))

/* netreap saw the ADD that wrote the file, and recorded every netns its
 * container was bound to */
#define recorded(g)  (p_nsid[g] != 0)
#define seen(i) ((p_bind[owner[i] - 1] & (1 << res_g[i])) != 0 && \
                 ftime[i] <= p_lastx[owner[i] - 1] && \
                 ((p_bind[owner[i] - 1] & 1) == 0 || recorded(0)) && \
                 ((p_bind[owner[i] - 1] & 2) == 0 || recorded(1)) && \
                 ((p_bind[owner[i] - 1] & 4) == 0 || recorded(2)))
#define stale(i) (owner[i] != 0 && !ns_alive[res_g[i]] && seen(i))
#define stale0 stale(0)
#define stale1 stale(1)

ltl no_dup   { [] nodup }
ltl released { [] ((stale0 -> <> !stale0) && (stale1 -> <> !stale1)) }

/* ======================= the world: kernel, runtime, plugin ======================= */

inline send_nl(kind, a, b) {
  if
  :: !down -> assert(len(nl) < QCAP); nl!kind, a, b, 0
  :: else -> skip          /* nobody listens: the event is lost */
  fi
}

inline send_rb(kind, c, g) {
  if
  :: !down -> assert(len(rb) < RCAP); rb!kind, c, g, tick
  :: else -> skip
  fi
}

#define in_use_ino(i)  ((ns_alive[0] && ns_ino[0] == i) || (ns_alive[1] && ns_ino[1] == i) || \
                        (ns_alive[2] && ns_ino[2] == i))
#define in_use_nsid(n) ((ns_alive[0] && ns_nsid[0] == n) || (ns_alive[1] && ns_nsid[1] == n) || \
                        (ns_alive[2] && ns_nsid[2] == n))

/* The kernel creates a netns: an inode no live netns has (a dead one's may
 * come back), the lowest free nsid (idr_alloc), RTM_NEWNSID. */
inline netns_create(g, n) {
  atomic {
    g = ng_next;
    ng_next++;
    if
    :: !in_use_ino(0) -> ns_ino[g] = 0
    :: !in_use_ino(1) -> ns_ino[g] = 1
    fi;
    n = 0;
    do
    :: in_use_nsid(n) -> n++
    :: else -> break
    od;
    assert(n < NNSID);
    ns_nsid[g] = n;
    ns_ip[g] = NONE;
    ns_alive[g] = 1;
    printf("MSC: netns %d created (inode %d, nsid %d)\n", g, ns_ino[g], n);
    send_nl(NEWNSID, n, g)
  }
}

/* The netns dies; its addresses go with it; RTM_DELNSID names only the
 * nsid, free for reuse from now on. */
inline netns_die(g, n) {
  atomic {
    ns_alive[g] = 0;
    ns_ip[g] = NONE;
    printf("MSC: netns %d dies (RTM_DELNSID nsid %d)\n", g, n);
    send_nl(DELNSID, n, 0)
  }
}

/* CNI ADD of container c in netns g. host-local's critical section (flock,
 * pick a free IP, write the file, unlock) is one step: nobody can see
 * inside it, netreap only waits for the flock. */
inline cni_add(c, g, n, ip) {
  running[c] = 1; run_g[c] = g; send_rb(ADDX, c, g);
  atomic {
    hl_lock == 0 ->
    ip = NONE;
    if
    :: owner[0] == c + 1 || owner[1] == c + 1 ->
       printf("MSC: ADD container %d: duplicate allocation, fails\n", c)
    :: else ->
       if
       :: owner[0] == 0 -> ip = 0
       :: owner[1] == 0 -> ip = 1
       :: else -> skip                     /* range full: ADD fails */
       fi;
       if
       :: ip != NONE ->                    /* the file: "containerID\r\nifname" */
          owner[ip] = c + 1;
          res_g[ip] = g;
          tick++;
          if
          :: fid[ip] = 1 - fid[ip]; ftime[ip] = tick; fooled[ip] = 0
#ifndef NO_FILE_ID_REUSE
          :: prev_owner[ip] == c + 1 -> fooled[ip] = 1;
             printf("MSC: (the new file has the old file's inode and mtime)\n")
#endif
          fi;
          prev_owner[ip] = c + 1;
          printf("MSC: ADD container %d in netns %d: host-local reserves IP %d\n", c, g, ip)
       :: else -> skip
       fi
    fi
  };
  /* then the address, and the plugin exits (one step: between the two,
   * both say "in use") */
  atomic {
    if
    :: ip != NONE ->
       ns_ip[g] = ip;
       printf("MSC: IP %d configured in netns %d\n", ip, g);
#ifdef ADDR_VIEW
       send_nl(ADDR, n, ip);
#endif
       skip
    :: ip != NONE ->                       /* a chained plugin failed */
       printf("MSC: ADD container %d fails before configuring IP %d\n", c, ip)
    :: ip == NONE -> skip
    fi;
    running[c] = 0; run_g[c] = NONE; send_rb(AEXIT, c, g); ip = 0
  }
}

/* CNI DEL of container c, as one step (its time in flight only adds a
 * reason to keep): it fails (the reservation leaks), or the interface goes
 * (A2) and host-local, under its flock, removes every file of c. */
inline cni_del(c, g, n) {
  if
  :: atomic { printf("MSC: DEL container %d fails\n", c) }   /* = no DEL */
  :: atomic {
       hl_lock == 0 ->
       if
       :: ns_alive[g] && ns_ip[g] != NONE -> ns_ip[g] = NONE
          /* no RTM_DELADDR: netreap's view goes stale, on the safe side */
       :: else -> skip
       fi;
       printf("MSC: DEL container %d frees its IPs\n", c);
       if :: owner[0] == c + 1 -> owner[0] = 0; res_g[0] = 0; fooled[0] = 0 :: else -> skip fi;
       if :: owner[1] == c + 1 -> owner[1] = 0; res_g[1] = 0; fooled[1] = 0 :: else -> skip fi
     }
  fi
}

/* A container (sandbox ID c). Each life: a netns, ADD, then teardown: DEL
 * (maybe), the netns dies, a DEL retry (maybe). */
proctype Pod(byte c; byte lives) {
  byte life, g, n, ip;
  do
  :: life < lives ->
     atomic {
       /* the runtime makes the netns and runs ADD in it at once */
       netns_create(g, n);
       cni_add(c, g, n, ip)
     }
     cni_del(c, g, n);                   /* fails, or no DEL at all */
     netns_die(g, n);
     cni_del(c, g, n);                   /* a retry, with no netns */
     atomic { life++; g = 0; n = 0 }
  :: else -> break
  od
}

/* ======================= netreap ======================= */

/* A message from the rtnetlink socket, in kernel order. Ordering is what
 * makes nsid reuse safe: the DELNSID of an nsid's old holder is always read
 * before anything about its new holder. */
inline handle_nl(kind, a, b, g) {
  if
  :: kind == NEWNSID ->                  /* also the reply to RTM_GETNSID */
     v_nsid[a] = b + 1;
     v_known[b] = 1;
     p_nsid[b] = a + 1
  :: kind == DELNSID ->
     if
     :: v_nsid[a] != 0 ->
        g = v_nsid[a] - 1;
        printf("MSC: netreap: netns %d seen to die\n", g);
        v_dead[g] = 1;
        v_known[g] = 0;
        v_ipg[g] = NONE;
        v_nsid[a] = 0
     :: else -> skip                     /* an nsid it never knew */
     fi
#ifdef ADDR_VIEW
  :: kind == ADDR ->
     if
     :: v_nsid[a] != 0 -> v_ipg[v_nsid[a] - 1] = b
     :: else -> skip
     fi
#endif
  fi
}

/* A record from the ring buffer: the CNI ledger. An ADD binds the container
 * to its netns (A1); a netns netreap does not know yet is asked for with
 * RTM_GETNSID on the socket, so the reply is read after any older DELNSID
 * of that nsid. */
inline handle_rb(kind, a, b, t) {
  if
  :: kind == ADDX ->
     v_run[a] = 1;
     v_bind[a] = v_bind[a] | (1 << b);
     p_bind[a] = p_bind[a] | (1 << b);
     if
     :: ns_alive[b] && !v_known[b] && !v_dead[b] && len(nl) < QCAP ->
        nl!NEWNSID, ns_nsid[b], b, 0
     :: else -> skip
     fi
  :: kind == AEXIT -> v_run[a] = 0; p_lastx[a] = t
  fi
}

/* Is netns k dead, as netreap knows it? */
inline is_dead(k, res) {
#ifdef BUG_INODE_DEATH
  /* BUG: a recorded death of the same inode counts */
  res = v_dead[k] || (v_dead[0] && ns_ino[0] == ns_ino[k]) ||
                     (v_dead[1] && ns_ino[1] == ns_ino[k]) ||
                     (v_dead[2] && ns_ino[2] == ns_ino[k])
#else
  res = v_dead[k]
#endif
}

/* The decision rule, on netreap's view, for the file <ip> of container c
 * with mtime dtime. ORPHANED only when: the file comes from an ADD netreap
 * saw to its end; the container was seen bound and every netns it was bound
 * to was seen to die; no CNI run of it is in flight; no live netns it
 * knows holds the IP. */
inline orphaned(c, ip, dtime, ok, k, res) {
#ifdef NO_RUN_DATING
  ok = (v_bind[c] != 0 && !v_run[c]);
#else
  ok = (v_bind[c] != 0 && !v_run[c] && dtime <= p_lastx[c]);
#endif
  for (k : 0 .. NG - 1) {
    is_dead(k, res);
    if
    :: ok && (v_bind[c] & (1 << k)) != 0 && !res -> ok = 0
#ifdef ADDR_VIEW
    :: ok && v_known[k] && !v_dead[k] && v_ipg[k] == ip -> ok = 0
#endif
    :: else -> skip
    fi
  }
}

/* A netns netreap recorded (its nsid is in the state dir) but does not see
 * now: ask the kernel about that nsid. Dead only on the kernel's word: the
 * nsid is listed no more, or it names a netns with another inode. The same
 * nsid with the same inode cannot be told apart: unknown, kept, asked again
 * later. */
inline check_recorded(g, k, found) {
  found = NONE;
  for (k : 0 .. NG - 1) {
    if
    :: ns_alive[k] && ns_nsid[k] == p_nsid[g] - 1 -> found = k
    :: else -> skip
    fi
  }
  if
  :: found == NONE ->
     v_dead[g] = 1; printf("MSC: netreap: nsid of netns %d no longer listed: dead\n", g)
  :: found != NONE && ns_ino[found] != ns_ino[g] ->
     v_dead[g] = 1; printf("MSC: netreap: nsid of netns %d names another inode: dead\n", g)
  :: else -> skip
  fi
}

inline close_intent(i) {
  p_int[i] = 0; p_owner[i] = 0; p_fid[i] = 0; p_ftime[i] = 0
}

/* Scratch variables are zeroed after use, so that they do not tell
 * otherwise equal states apart. */
inline scratch_clear() {
  kind = 0; a = 0; b = 0; t = 0; g = 0; k = 0; res = 0; found = 0
}

/* netreap reads a source until it is empty (recvmsg until EAGAIN). One
 * step: reading only a prefix is the same as reading all of it at the
 * moment the prefix was all there was. */
inline drain_nl() {
  do
  :: nl?kind, a, b, t -> handle_nl(kind, a, b, g)
  :: empty(nl) -> break
  od;
  scratch_clear()
}

inline drain_rb() {
  do
  :: rb?kind, a, b, t -> handle_rb(kind, a, b, t)
  :: empty(rb) -> break
  od;
  scratch_clear()
}

/* netreap's dump of the kernel's nsid table (a periodic resync): it can miss
 * any live netns. */
inline resync() {
  for (g : 0 .. NG - 1) {
#ifdef BUG_DUMP_DEATH
    if
    :: v_known[g] && !v_dead[g] ->
       if
       :: ns_alive[g] -> skip                  /* listed */
       :: v_dead[g] = 1; v_known[g] = 0;       /* BUG: missing = dead */
          printf("MSC: netreap: netns %d missing from a dump: dead\n", g)
       fi
    :: else -> skip
    fi
#else
    if
    :: ns_alive[g] && !v_known[g] && !v_dead[g] && len(nl) < QCAP ->
       if
       :: nl!NEWNSID, ns_nsid[g], g, 0         /* listed: learnt, in order */
       :: skip                                 /* missed: stays unknown */
       fi
    :: else -> skip
    fi
#endif
  }
}

active proctype Netreap() {
  mtype kind;
  byte a, b, t, g, k, i, c, found, grp;
  byte d_owner[NIP], d_ftime[NIP];           /* the files decided about */
  bit d_fid[NIP];
  bool ok, res, seen[NIP];

end_loop:
  do
  :: atomic { nempty(nl) -> drain_nl() }
  :: atomic { nempty(rb) -> drain_rb() }
  :: atomic {
       empty(nl) && empty(rb) ->
       /* recorded netns it does not see now: ask the kernel again */
       for (g : 0 .. NG - 1) {
         if
         :: p_nsid[g] != 0 && !v_known[g] && !v_dead[g] -> check_recorded(g, k, found)
         :: else -> skip
         fi
       }
       /* sometimes a resync */
       if
       :: skip
       :: resync()
       fi;
       /* a scan: read and decide every file <ip>; the orphans form one
        * group (a batch: each network's files are released under one
        * hold of its lock). A pending intent (after a restart) is
        * re-verified like any other, never redone blindly. */
       grp = 0;
       for (i : 0 .. NIP - 1) {
         if
         :: owner[i] != 0 ->
            c = owner[i] - 1;
            if
            :: p_int[i] && (c != p_owner[i] || fid[i] != p_fid[i] || ftime[i] != p_ftime[i]) ->
               close_intent(i)                       /* the intent's file is gone */
            :: else -> skip
            fi;
            orphaned(c, i, ftime[i], ok, k, res);
            if
            :: ok -> grp = grp | (1 << i);
               d_owner[i] = c; d_fid[i] = fid[i]; d_ftime[i] = ftime[i]
            :: !ok && p_int[i] -> close_intent(i)    /* re-verified: kept */
            :: else -> skip
            fi
         :: owner[i] == 0 && p_int[i] ->
            close_intent(i)                          /* the intent's file is gone */
         :: else -> skip
         fi
       }
       i = 0; c = 0; ok = 0;
       scratch_clear();
       if
       :: grp != 0 ->
          /* the group's intents, fsync'd (one write) before acting */
          for (i : 0 .. NIP - 1) {
            if
            :: (grp & (1 << i)) != 0 ->
               p_int[i] = 1; p_owner[i] = d_owner[i]; p_fid[i] = d_fid[i]; p_ftime[i] = d_ftime[i];
               printf("MSC: netreap: IP %d of container %d orphaned, intent fsync'd\n", i, d_owner[i])
            :: else -> skip
            fi
          }
          i = 0;
          if
          :: crashes < MAXCRASH ->
             crashes++; printf("MSC: netreap crashes\n"); goto crash
          :: true -> skip
          fi
       :: else -> skip
       fi
     };
     if
     :: grp != 0 ->
        /* The last look, once for the group, under the plugin's flock held
         * across the group's unlinks. In this order: the kernel read (is
         * each IP configured in any live netns, A3), then drain the ring
         * buffer (is a CNI run of the container in flight?). The order
         * matters: a run that configures an IP after the kernel read has
         * its exec before the drain. Then, per file, still under the same
         * hold of the lock: is it still the file decided about (owner,
         * inode, mtime)? Then the unlink. */
#ifdef LOOK_BEFORE_LOCK
        /* bug: the group's look is taken before the flock (one look for a
         * batch, shared across a lock that is not held): a file re-created
         * in between passes the identity check */
        atomic {
          for (i : 0 .. NIP - 1) {
            seen[i] = in_live(0, i) || in_live(1, i) || in_live(2, i)
          }
          i = 0;
          drain_rb()
        };
#endif
        atomic {
          hl_lock == 0 -> hl_lock = 1;
#if !defined(BUG_NO_LAST_LOOK) && !defined(LOOK_BEFORE_LOCK)
          for (i : 0 .. NIP - 1) {
            seen[i] = in_live(0, i) || in_live(1, i) || in_live(2, i)
          }
          i = 0
#else
          skip
#endif
        };
        atomic {
#if !defined(BUG_NO_LAST_LOOK) && !defined(LOOK_BEFORE_LOCK)
          drain_rb();
#endif
          for (i : 0 .. NIP - 1) {
            if
            :: (grp & (1 << i)) != 0 ->
               c = d_owner[i];
               ok = (owner[i] == c + 1 && fid[i] == d_fid[i] && ftime[i] == d_ftime[i]);
#ifndef BUG_NO_LAST_LOOK
               ok = ok && !seen[i] && !v_run[c];
#endif
               if
               :: ok ->
#ifndef NO_S2
                  assert(!in_live(0, i) && !in_live(1, i) && !in_live(2, i)); /* S2a */
                  assert(!ns_alive[res_g[i]] || fooled[i]);                   /* S2b */
#endif
#ifndef BUG_NEVER_UNLINK
                  owner[i] = 0; res_g[i] = 0; fooled[i] = 0;
#endif
                  printf("MSC: netreap unlinks IP %d\n", i)
               :: else -> printf("MSC: netreap: last look keeps IP %d\n", i)
               fi;
               close_intent(i)                       /* the outcome, journaled */
            :: else -> skip
            fi;
            seen[i] = 0; d_owner[i] = 0; d_fid[i] = 0; d_ftime[i] = 0
          }
          hl_lock = 0;
          scratch_clear(); i = 0; c = 0; ok = 0; grp = 0
        }
     :: else -> skip
     fi
  od;

crash:
  /* netreap dies between the intent and the unlink: memory and sockets go */
  atomic {
    down = 1;
    do
    :: nl?_, _, _, _
    :: rb?_, _, _, _
    :: empty(nl) && empty(rb) -> break
    od;
    for (g : 0 .. NG - 1) { v_known[g] = 0; v_dead[g] = 0; v_ipg[g] = NONE }
    for (g : 0 .. NNSID - 1) { v_nsid[g] = 0 }
    for (c : 0 .. NC - 1) { v_bind[c] = 0; v_run[c] = 0 }
    scratch_clear(); c = 0; i = 0; grp = 0; ok = 0;
    for (g : 0 .. NIP - 1) { d_owner[g] = 0; d_fid[g] = 0; d_ftime[g] = 0; seen[g] = 0 }
    g = 0
  };
  /* ... the world goes on while it is down ... */
  atomic {
    down = 0;
    printf("MSC: netreap restarts\n");
    /* discovery and an nsid dump: either can miss any live netns */
    for (g : 0 .. NG - 1) {
      if
      :: ns_alive[g] ->
         v_nsid[ns_nsid[g]] = g + 1; v_known[g] = 1;
#ifdef ADDR_VIEW
         v_ipg[g] = ns_ip[g];
#endif
         p_nsid[g] = ns_nsid[g] + 1
      :: skip
      fi
    }
    /* bindings from the state dir; CNI runs in flight from /proc (A3) */
    for (c : 0 .. NC - 1) {
      v_bind[c] = p_bind[c];
      v_run[c] = running[c];
      if
      :: running[c] && run_g[c] != NONE ->
         v_bind[c] = v_bind[c] | (1 << run_g[c]);
         p_bind[c] = v_bind[c]
      :: else -> skip
      fi
    }
    /* recorded netns the dump did not show */
    for (g : 0 .. NG - 1) {
      if
      :: p_nsid[g] != 0 && !v_known[g] ->
#ifdef BUG_DUMP_DEATH
         v_dead[g] = 1;                  /* BUG: not in the dump = dead */
         printf("MSC: netreap: netns %d missing from a dump: dead\n", g)
#else
         check_recorded(g, k, found)
#endif
      :: else -> skip
      fi
    }
    scratch_clear(); c = 0
  };
  goto end_loop
}

init {
  atomic {
    byte i;
    for (i : 0 .. NG - 1) { ns_ip[i] = NONE; v_ipg[i] = NONE }
    for (i : 0 .. NC - 1) { run_g[i] = NONE }
    run Pod(0, LIVES0);
    run Pod(1, LIVES1)
  }
}
