"""The Kafka room: every use of Kafka's client library (aiokafka) by the daemons and the
operator tools goes through here.

* ``clients.py`` builds every producer, consumer and admin client from the settings;
* ``errors.py`` maps aiokafka's errors onto the framework's tree, at this border;
* ``aiokafka_internals.py`` is the one module that uses aiokafka beyond its documented
  API, each capability checked at a daemon's start (``tests/unit/test_aiokafka_internals.py``
  fails when a private name appears anywhere else);
* ``metadata_watch.py`` keeps a client's view of the partition leaders fresh when a broker
  hangs; ``admin.py`` reads admin answers; ``oauthbearer.py`` is the OAUTHBEARER token
  provider from the settings.

It belongs to the core (``outbox/``): the core and every subpackage may import it.
"""
